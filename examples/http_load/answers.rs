//! The extender's answers as the load generator reads them: borrowed from the response bytes (it
//! shares the cores with the server), checked against the candidates it sent.

use super::*;

#[derive(Deserialize)]
pub(super) struct FilterAnswer<'a> {
    #[serde(rename = "Nodes", borrow, default)]
    nodes: Option<AnswerNodes<'a>>,
    #[serde(rename = "FailedNodes", borrow, default)]
    failed: Option<HashMap<&'a str, serde::de::IgnoredAny>>,
    #[serde(rename = "FailedAndUnresolvableNodes", borrow, default)]
    unresolvable: Option<HashMap<&'a str, serde::de::IgnoredAny>>,
    #[serde(rename = "Error", default)]
    error: Option<String>,
}

#[derive(Deserialize)]
pub(super) struct AnswerNodes<'a> {
    #[serde(borrow, default)]
    items: Option<Vec<AnswerNode<'a>>>,
}

#[derive(Deserialize)]
pub(super) struct AnswerNode<'a> {
    #[serde(borrow)]
    metadata: AnswerMeta<'a>,
}

#[derive(Deserialize)]
pub(super) struct AnswerMeta<'a> {
    #[serde(borrow)]
    name: &'a str,
}

/// A small JSON cursor for checking answers without building a document: the load generator
/// shares the two cores with the server, and serde_json with maps of borrowed keys cost it about as
/// much per pair as the server spent answering. Only the shapes the extender answers with are
/// accepted; anything else is an error.
pub(super) struct Cur<'a> {
    b: &'a [u8],
    i: usize,
}

pub(super) const ONES: u64 = u64::MAX / 255;

impl<'a> Cur<'a> {
    fn err<T>(&self, what: &str) -> Result<T> {
        let end = (self.i + 40).min(self.b.len());
        Err(LoadError::Answer(format!(
            "answer: expected {what} at byte {}: {:?}",
            self.i,
            String::from_utf8_lossy(&self.b[self.i.min(end)..end])
        )))
    }

    fn ws(&mut self) {
        while let Some(b' ' | b'\n' | b'\r' | b'\t') = self.b.get(self.i) {
            self.i += 1;
        }
    }

    fn eat(&mut self, c: u8) -> bool {
        self.ws();
        if self.b.get(self.i) == Some(&c) {
            self.i += 1;
            true
        } else {
            false
        }
    }

    fn expect(&mut self, c: u8) -> Result<()> {
        if self.eat(c) {
            Ok(())
        } else {
            self.err(&format!("{:?}", c as char))
        }
    }

    fn null(&mut self) -> bool {
        self.ws();
        if self.b[self.i.min(self.b.len())..].starts_with(b"null") {
            self.i += 4;
            true
        } else {
            false
        }
    }

    /// A string's raw bytes (escapes left as they are), 8 bytes at a time to the closing quote.
    fn string(&mut self) -> Result<&'a [u8]> {
        self.expect(b'"')?;
        let start = self.i;
        let b = self.b;
        loop {
            if let Some(chunk) = b.get(self.i..self.i + 8) {
                let w = u64::from_le_bytes([
                    chunk[0], chunk[1], chunk[2], chunk[3], chunk[4], chunk[5], chunk[6], chunk[7],
                ]);
                let zero = |x: u64| x.wrapping_sub(ONES) & !x & (ONES << 7);
                let m = zero(w ^ (ONES * u64::from(b'"'))) | zero(w ^ (ONES * u64::from(b'\\')));
                if m == 0 {
                    self.i += 8;
                    continue;
                }
                self.i += (m.trailing_zeros() / 8) as usize;
            }
            match b.get(self.i) {
                Some(b'"') => {
                    self.i += 1;
                    return Ok(&b[start..self.i - 1]);
                }
                Some(b'\\') => self.i += 2,
                Some(_) => self.i += 1,
                None => return self.err("the end of a string"),
            }
        }
    }

    /// `{` key `:` value, … `}`, calling `f` with each key (which must read the value).
    fn object(&mut self, mut f: impl FnMut(&mut Self, &'a [u8]) -> Result<()>) -> Result<()> {
        self.expect(b'{')?;
        if self.eat(b'}') {
            return Ok(());
        }
        loop {
            self.ws();
            let k = self.string()?;
            self.expect(b':')?;
            f(self, k)?;
            if self.eat(b',') {
                continue;
            }
            return self.expect(b'}');
        }
    }

    /// `[` item, … `]` (`f` starts at the item, whitespace skipped).
    fn array(&mut self, mut f: impl FnMut(&mut Self) -> Result<()>) -> Result<()> {
        self.expect(b'[')?;
        if self.eat(b']') {
            return Ok(());
        }
        loop {
            self.ws();
            f(self)?;
            if self.eat(b',') {
                continue;
            }
            return self.expect(b']');
        }
    }

    fn int(&mut self) -> Result<i64> {
        self.ws();
        let start = self.i;
        while self.b.get(self.i).is_some_and(|c| c.is_ascii_digit() || *c == b'-') {
            self.i += 1;
        }
        std::str::from_utf8(&self.b[start..self.i])
            .ok()
            .and_then(|t| t.parse().ok())
            .map_or_else(|| self.err("an integer"), Ok)
    }

    fn end(&mut self) -> Result<()> {
        self.ws();
        if self.i == self.b.len() {
            Ok(())
        } else {
            self.err("the end")
        }
    }
}

/// The passing nodes of a filter answer, checked: no error, every candidate answered once, and the
/// passing ones in the order sent (`candidates` in request order). Returns the candidates' own
/// names: each passing name is matched against the next candidates in turn, which finds it without
/// scanning for its end.
pub(super) fn passing<'c>(mode: Mode, answer: &[u8], candidates: &'c [String]) -> Result<Vec<&'c str>> {
    if mode == Mode::Nodes {
        let n = passing_nodes(answer, candidates.len())?;
        // full-Nodes answers carry names of their own; return ours, in the order answered
        let mut sent = candidates.iter();
        return n
            .iter()
            .map(|p| {
                sent.find(|c| c == p)
                    .map(String::as_str)
                    .ok_or_else(|| LoadError::Answer(format!("filter passed {p:?}, not a candidate (or out of order)")))
            })
            .collect();
    }
    let mut c = Cur { b: answer, i: 0 };
    let (mut pass, mut failed, mut error) = (Vec::with_capacity(candidates.len()), 0usize, &b""[..]);
    let mut next = 0;
    c.object(|c, key| {
        match key {
            b"Nodes" if c.null() => {}
            b"NodeNames" if c.null() => {}
            b"NodeNames" => c.array(|c| {
                c.expect(b'"')?;
                loop {
                    let Some(n) = candidates.get(next) else {
                        return c.err("a candidate's name (or the names out of order)");
                    };
                    next += 1;
                    if c.b.get(c.i..c.i + n.len()) == Some(n.as_bytes()) && c.b.get(c.i + n.len()) == Some(&b'"') {
                        c.i += n.len() + 1;
                        pass.push(n.as_str());
                        return Ok(());
                    }
                }
            })?,
            b"FailedNodes" | b"FailedAndUnresolvableNodes" if c.null() => {}
            b"FailedNodes" | b"FailedAndUnresolvableNodes" => c.object(|c, _| {
                failed += 1;
                c.string().map(|_| ())
            })?,
            b"Error" if c.null() => {}
            b"Error" => error = c.string()?,
            other => return c.err(&format!("a filter answer field, not {:?}", String::from_utf8_lossy(other))),
        }
        Ok(())
    })?;
    c.end()?;
    if !error.is_empty() {
        return Err(LoadError::Answer(format!("filter: Error {:?}", String::from_utf8_lossy(error))));
    }
    if pass.len() + failed != candidates.len() {
        return Err(LoadError::Answer(format!(
            "filter answered {} passing + {failed} failed for {} candidates",
            pass.len(),
            candidates.len()
        )));
    }
    Ok(pass)
}

/// [`passing`] for full-Nodes answers (the Node objects are large; serde_json skips them well).
pub(super) fn passing_nodes(answer: &[u8], candidates: usize) -> Result<Vec<&str>> {
    let a: FilterAnswer<'_> = serde_json::from_slice(answer)?;
    if let Some(e) = a.error.as_deref().filter(|e| !e.is_empty()) {
        return Err(LoadError::Answer(format!("filter: Error {e:?}")));
    }
    let pass: Vec<&str> =
        a.nodes.and_then(|n| n.items).unwrap_or_default().into_iter().map(|n| n.metadata.name).collect();
    let failed = a.failed.map_or(0, |m| m.len()) + a.unresolvable.map_or(0, |m| m.len());
    if pass.len() + failed != candidates {
        return Err(LoadError::Answer(format!(
            "filter answered {} passing + {failed} failed for {candidates} candidates",
            pass.len()
        )));
    }
    Ok(pass)
}

/// Checks a prioritize answer (one score 0..=10 per candidate, in order) and returns the position
/// of the best node (the first of the best). Entries in the form the extender writes are matched
/// against the expected name directly; others are parsed.
pub(super) fn check_priorities(answer: &[u8], candidates: &[&str]) -> Result<usize> {
    const HOST: &[u8] = b"{\"Host\":\"";
    const SCORE: &[u8] = b"\",\"Score\":";
    let mut c = Cur { b: answer, i: 0 };
    let (mut k, mut best) = (0usize, (0usize, -1i64));
    c.array(|c| {
        let want = candidates.get(k).copied().unwrap_or("(none)");
        let (host_end, score_at) = (c.i + HOST.len() + want.len(), c.i + HOST.len() + want.len() + SCORE.len());
        let plain = c.b.get(c.i..c.i + HOST.len()) == Some(HOST)
            && c.b.get(c.i + HOST.len()..host_end) == Some(want.as_bytes())
            && c.b.get(host_end..score_at) == Some(SCORE);
        let (host, score) = if plain {
            c.i = score_at;
            let s = c.int()?;
            c.expect(b'}')?;
            (Some(want.as_bytes()), Some(s))
        } else {
            let (mut host, mut score) = (None, None);
            c.object(|c, key| {
                match key {
                    b"Host" => host = Some(c.string()?),
                    b"Score" => score = Some(c.int()?),
                    other => return c.err(&format!("Host or Score, not {:?}", String::from_utf8_lossy(other))),
                }
                Ok(())
            })?;
            (host, score)
        };
        match (host, score) {
            (Some(h), Some(s)) if h == want.as_bytes() && (0..=10).contains(&s) => {
                if s > best.1 {
                    best = (k, s);
                }
            }
            (h, s) => {
                let h = h.map(String::from_utf8_lossy);
                return Err(LoadError::Answer(format!("prioritize: {h:?}={s:?} for {want}")));
            }
        }
        k += 1;
        Ok(())
    })?;
    c.end()?;
    if k != candidates.len() {
        return Err(LoadError::Answer(format!("prioritize: {k} scores for {} nodes", candidates.len())));
    }
    Ok(best.0)
}
