//! Decoding filter and prioritize bodies ([`decode_args`]), with a fast path for bodies as
//! kube-scheduler writes them: the top
//! object's three fields are found by a small scanner, the Pod (and a full-Nodes list) are decoded
//! by serde_json from their own byte ranges, and the `NodeNames` strings are taken as slices of the
//! body. serde_json spent about 370 instructions per name (string parsing, UTF-8 validation per
//! string, the sequence machinery); this scanner looks at 8 bytes at a time.
//!
//! It only ever answers for bodies it fully understands and otherwise says `None`, and the caller
//! decodes with serde_json as before (and gets serde_json's error messages): unknown or repeated
//! keys, names with escapes, control characters or non-ASCII bytes, anything but strings in
//! `NodeNames`. For the bodies it does answer, the result is what serde_json would give (held by a
//! property test against [`decode`](crate::extender::wire::decode)): the scanner accepts only
//! strictly valid JSON around the values it hands to serde_json, and serde_json checks those values
//! whole (trailing characters included).

use std::borrow::Cow;

use crate::extender::wire::{
    decode, node_limit, ExtenderArgs, ExtenderArgsRef, GoType, NodeList, NodeName, Pod, WireError, NODE_LIMIT_HIT,
};

/// Decodes a filter or prioritize body with borrowed names. Errors are exactly [`decode`]'s for
/// [`ExtenderArgs`]: a body this fast decoder refuses is decoded again by that one, which names
/// the field (and, should it accept the body after all, its answer is used).
pub fn decode_args(body: &[u8]) -> Result<ExtenderArgsRef<'_>, WireError> {
    if let Some(args) = scan_args(body) {
        return Ok(args);
    }
    NODE_LIMIT_HIT.set(false);
    match serde_json::from_slice::<ExtenderArgsRef<'_>>(body) {
        Ok(args) => Ok(args),
        // over the limit: refused without decoding the body a second time
        Err(_) if NODE_LIMIT_HIT.get() => {
            Err(WireError::TooManyNodes { go_type: <ExtenderArgs as GoType>::GO_NAME, limit: node_limit() })
        }
        Err(_) => decode::<ExtenderArgs>(body).map(ExtenderArgsRef::from),
    }
}

const ONES: u64 = u64::MAX / 255;
/// Deeper values go to serde_json, whose nesting limit (128) counts from the body's top.
const MAX_DEPTH: usize = 100;
const HIGH: u64 = ONES << 7;

/// Per byte of `w`, the high bit set where the byte is `"`, `\`, below 0x20 or above 0x7F (the
/// lowest set bit marks the first such byte exactly; bits above it may be spurious).
#[inline]
fn specials(w: u64) -> u64 {
    let zero = |x: u64| x.wrapping_sub(ONES) & !x;
    let ctrl = w.wrapping_sub(ONES * 0x20) & !w;
    (ctrl | zero(w ^ (ONES * u64::from(b'"'))) | zero(w ^ (ONES * u64::from(b'\\'))) | w) & HIGH
}

struct Scanner<'a> {
    /// The body, known to be UTF-8 (checked once, in bulk: per string it cost more than the scan).
    text: &'a str,
    b: &'a [u8],
    i: usize,
}

impl<'a> Scanner<'a> {
    fn ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.b.get(self.i) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        if self.b.get(self.i) == Some(&c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn eat_null(&mut self) -> bool {
        if self.b.get(self.i..).is_some_and(|r| r.starts_with(b"null")) {
            self.i += 4;
            true
        } else {
            false
        }
    }

    /// A string of printable ASCII without escapes, as a slice of the body; `None` for anything else.
    fn simple_str(&mut self) -> Option<&'a str> {
        if !self.eat(b'"') {
            return None;
        }
        let start = self.i;
        let b = self.b;
        let mut i = start;
        while let Some(chunk) = b.get(i..i + 8) {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            let m = specials(u64::from_le_bytes(word));
            if m != 0 {
                i += (m.trailing_zeros() / 8) as usize;
                return self.end_str(start, i);
            }
            i += 8;
        }
        while let Some(&c) = b.get(i) {
            if c == b'"' || c == b'\\' || !(0x20..0x80).contains(&c) {
                return self.end_str(start, i);
            }
            i += 1;
        }
        None
    }

    fn end_str(&mut self, start: usize, end: usize) -> Option<&'a str> {
        if self.b.get(end) != Some(&b'"') {
            return None;
        }
        self.i = end + 1;
        // both ends are next to a quote, so on character boundaries
        self.text.get(start..end)
    }

    /// Skips one JSON value, returning its bytes. Strings are skipped escape-aware and brackets
    /// counted outside them; the value is not validated here (serde_json decodes it whole, and
    /// refuses it if these bounds were wrong).
    fn value(&mut self) -> Option<&'a [u8]> {
        let start = self.i;
        let b = self.b;
        let mut depth = 0usize;
        loop {
            let c = *b.get(self.i)?;
            match c {
                b'"' => {
                    self.i += 1;
                    loop {
                        match *b.get(self.i)? {
                            b'\\' => self.i += 2,
                            b'"' => break,
                            _ => self.i += 1,
                        }
                    }
                    self.i += 1;
                }
                b'{' | b'[' => {
                    depth += 1;
                    if depth > MAX_DEPTH {
                        // serde_json's recursion limit counts from the top of the body
                        return None;
                    }
                    self.i += 1;
                }
                b'}' | b']' => {
                    if depth == 0 {
                        // the end of the enclosing object: a scalar ended here
                        break;
                    }
                    depth -= 1;
                    self.i += 1;
                }
                b',' if depth == 0 => break,
                _ => self.i += 1,
            }
            if depth == 0 && matches!(c, b'"' | b'}' | b']') {
                break;
            }
        }
        let v = &b[start..self.i];
        (!v.is_empty()).then_some(v)
    }
}

/// Decodes a filter or prioritize body if it is in the plain form kube-scheduler writes; `None`
/// sends the caller to serde_json.
pub(crate) fn scan_args(body: &[u8]) -> Option<ExtenderArgsRef<'_>> {
    let text = std::str::from_utf8(body).ok()?;
    let mut s = Scanner { text, b: body, i: 0 };
    s.ws();
    if !s.eat(b'{') {
        return None;
    }
    let mut pod: Option<&[u8]> = None;
    let mut nodes: Option<Option<&[u8]>> = None;
    let mut names: Option<Option<Vec<NodeName<'_>>>> = None;
    s.ws();
    if !s.eat(b'}') {
        loop {
            s.ws();
            let key = s.simple_str()?;
            s.ws();
            if !s.eat(b':') {
                return None;
            }
            s.ws();
            match key {
                "Pod" if pod.is_none() => pod = Some(s.value()?),
                "Nodes" if nodes.is_none() => nodes = Some(if s.eat_null() { None } else { Some(s.value()?) }),
                "NodeNames" if names.is_none() => {
                    names = Some(if s.eat_null() { None } else { Some(name_list(&mut s)?) })
                }
                // unknown or repeated keys: serde_json decides
                _ => return None,
            }
            s.ws();
            if s.eat(b',') {
                continue;
            }
            if s.eat(b'}') {
                break;
            }
            return None;
        }
    }
    s.ws();
    if s.i != body.len() {
        return None;
    }
    let pod: Pod = serde_json::from_slice(pod?).ok()?;
    let nodes = match nodes.flatten() {
        Some(raw) => Some(serde_json::from_slice::<NodeList>(raw).ok()?),
        None => None,
    };
    Some(ExtenderArgsRef { pod, nodes, node_names: names.flatten() })
}

/// `["a","b",…]` of simple strings.
fn name_list<'a>(s: &mut Scanner<'a>) -> Option<Vec<NodeName<'a>>> {
    if !s.eat(b'[') {
        return None;
    }
    // names run about 16 bytes with their quotes and comma; never more than the node limit, past
    // which serde_json's decoder refuses the body with the limit's error
    let max = node_limit();
    let mut out = Vec::with_capacity(((s.b.len() - s.i) / 16 + 1).min(max));
    s.ws();
    if s.eat(b']') {
        return Some(out);
    }
    loop {
        s.ws();
        if out.len() >= max {
            return None;
        }
        out.push(NodeName(Cow::Borrowed(s.simple_str()?)));
        s.ws();
        if s.eat(b',') {
            continue;
        }
        if s.eat(b']') {
            return Some(out);
        }
        return None;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extender::wire::{decode, ExtenderArgs};

    fn agrees(body: &[u8]) {
        if let Some(fast) = scan_args(body) {
            let slow: ExtenderArgs = decode(body)
                .unwrap_or_else(|e| panic!("{}: scanned but serde_json says {e}", String::from_utf8_lossy(body)));
            assert_eq!(fast.into_owned(), slow, "{}", String::from_utf8_lossy(body));
        }
    }

    #[test]
    fn plain_bodies_are_scanned_and_agree_with_serde_json() {
        let ok: &[&[u8]] = &[
            br#"{"Pod":{},"Nodes":null,"NodeNames":["a","b"]}"#,
            br#" { "Pod" : {"metadata":{"name":"p","annotations":{"x":"}]\"["}}} , "NodeNames" : [ "gpu-node-1" , "x" ] } "#,
            br#"{"NodeNames":[],"Pod":{"spec":{"containers":[{"name":"c"}]}}}"#,
            br#"{"Pod":{},"Nodes":{"metadata":{},"items":[{"metadata":{"name":"n"}}]},"NodeNames":null}"#,
            br#"{"Pod":{}}"#,
            b"{\"Pod\":{},\"NodeNames\":[\"abcdefghijklmnopqrstuvwxyz0123456789\",\"1234567\",\"12345678\",\"123456789\"]}",
        ];
        for b in ok {
            assert!(scan_args(b).is_some(), "{}", String::from_utf8_lossy(b));
            agrees(b);
        }
        let names = scan_args(ok[5]).unwrap().into_owned().node_names.unwrap();
        assert_eq!(names, ["abcdefghijklmnopqrstuvwxyz0123456789", "1234567", "12345678", "123456789"]);
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 2000, ..Default::default() })]

        /// Bodies a few edits away from kube-scheduler's: whenever the scanner answers, serde_json
        /// accepts the body and decodes it to the same arguments.
        #[test]
        fn scanned_bodies_agree_with_serde_json(
            base in 0usize..3,
            edits in proptest::collection::vec((0usize..200, 0u8..3, proptest::sample::select(b"{}[]\",:\\ nul0a\t\xc3".to_vec())), 0..4),
        ) {
            let bases: [&[u8]; 3] = [
                br#"{"Pod":{"metadata":{"name":"p","uid":"u","annotations":{"a":"x\"y"}},"spec":{"containers":[{"name":"c","resources":{"limits":{"gpuplace.io/gpu":"1"}}}]}},"Nodes":null,"NodeNames":["n-1","n-2","n-3"]}"#,
                br#"{"Pod":{},"Nodes":{"metadata":{},"items":[{"metadata":{"name":"a"}},{"metadata":{"name":"b"}}]},"NodeNames":null}"#,
                br#" {"NodeNames" : [ "x" ] , "Pod" : { "spec" : null } } "#,
            ];
            let mut body = bases[base].to_vec();
            for (at, kind, byte) in edits {
                let at = at % (body.len() + 1);
                match kind {
                    0 if at < body.len() => body[at] = byte,
                    1 if at < body.len() => {
                        body.remove(at);
                    }
                    _ => body.insert(at, byte),
                }
            }
            agrees(&body);
        }
    }

    #[test]
    fn anything_unusual_goes_to_serde_json() {
        let refused: &[&[u8]] = &[
            br#"{"Pod":{},"NodeNames":["a\"b"]}"#,
            br#"{"Pod":{},"NodeNames":["a\u0062"]}"#,
            "{\"Pod\":{},\"NodeNames\":[\"ünï\"]}".as_bytes(),
            b"{\"Pod\":{},\"NodeNames\":[\"a\tb\"]}",
            br#"{"Pod":{},"NodeNames":["a",1]}"#,
            br#"{"Pod":{},"NodeNames":["a",]}"#,
            br#"{"Pod":{},"NodeNames":["a"],"Extra":1}"#,
            br#"{"Pod":{},"Pod":{},"NodeNames":["a"]}"#,
            br#"{"Pod":{},"NodeNames":["a"]} x"#,
            br#"{"Pod":{},"NodeNames":["a"]"#,
            br#"{"Pod":{"metadata":{"name":"p"},"NodeNames":["a"]}"#,
            br#"{"Pod":null,"NodeNames":["a"]}"#,
            br#"{"Pod":[],"NodeNames":["a"]}"#,
            br#"{"Pod":{}x,"NodeNames":["a"]}"#,
            br#"{"Pod":{} "NodeNames":["a"]}"#,
            br#"["Pod"]"#,
            b"",
        ];
        for b in refused {
            assert!(scan_args(b).is_none(), "{}", String::from_utf8_lossy(b));
        }
    }
}
