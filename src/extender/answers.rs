//! The filter and prioritize answers written as kube-scheduler reads them, straight into one byte
//! buffer: names as sent (no escaping where the request had none), each reason's JSON made once per
//! text by the scheduler ([`Reason::json`]), Node objects echoed as received. The wire types'
//! serde encoding gives the same JSON (tests here); it serves tests and the rare error answers.

use crate::extender::wire::{
    ExtenderArgsRef, ExtenderFilterResult, FailedNodesMap, HostPriority, HostPriorityList, NodeList,
    MAX_EXTENDER_PRIORITY,
};
use crate::scheduler::verdict_cache::{push_str, Answer, Candidates, Reason, MAX_SCORE};

// the scheduler's score scale is the extender protocol's priority scale
const _: () = assert!(MAX_SCORE == MAX_EXTENDER_PRIORITY);

/// A candidate's name as a JSON string.
#[inline]
fn push_name(out: &mut Vec<u8>, name: &str, verbatim: bool) {
    if verbatim {
        out.push(b'"');
        out.extend_from_slice(name.as_bytes());
        out.push(b'"');
    } else {
        push_str(out, name);
    }
}

fn push_score(out: &mut Vec<u8>, score: u8) {
    let s = score.min(10);
    if s == 10 {
        out.extend_from_slice(b"10");
    } else {
        out.push(b'0' + s);
    }
}

/// The filter answer's JSON (as [`filter_result`] would serialize, except that the failure maps
/// list nodes in request order rather than by name, which decoders do not see).
pub fn filter_json(args: &ExtenderArgsRef<'_>, c: &Candidates<'_>, answers: &[Answer]) -> Vec<u8> {
    let verbatim = args.names_verbatim();
    // one pass writes the passing nodes and sets the failures aside (each name once)
    let mut failed: [Vec<(&str, &Reason)>; 2] = [Vec::new(), Vec::new()];
    let mut failed_bytes = 0;
    let items = args.nodes.as_ref().map(|l| (l, l.items.as_slice()));
    // names run under 24 bytes; Node objects are echoed whole
    let echoed = items.map_or(0, |(_, items)| items.iter().map(|n| n.raw_json().len() + 1).sum::<usize>());
    let mut out = Vec::with_capacity(c.names.len() * 24 + echoed + 256);
    out.extend_from_slice(b"{\"Nodes\":");
    match items {
        Some((list, _)) => {
            out.extend_from_slice(b"{\"metadata\":");
            let _ = serde_json::to_writer(&mut out, &list.metadata);
            out.extend_from_slice(b",\"items\":[");
        }
        None => out.extend_from_slice(b"null,\"NodeNames\":["),
    }
    let mut sep = false;
    for (p, (name, a)) in c.names.iter().zip(answers).enumerate() {
        match a {
            Answer::Fits(..) => {
                if std::mem::replace(&mut sep, true) {
                    out.push(b',');
                }
                match items {
                    Some((_, items)) => out.extend_from_slice(items.get(p).map_or("null", |n| n.raw_json()).as_bytes()),
                    None => push_name(&mut out, name, verbatim),
                }
            }
            Answer::No(r) if c.first.get(p) == Some(&true) => {
                failed_bytes += name.len() + r.json().len() + 4;
                failed[usize::from(r.unresolvable())].push((name, r));
            }
            Answer::No(_) | Answer::NotOffered => {}
        }
    }
    out.extend_from_slice(if items.is_some() { b"]},\"NodeNames\":null" } else { b"]" });
    out.reserve(failed_bytes + 64);
    for (key, list) in [&b",\"FailedNodes\":{"[..], b"},\"FailedAndUnresolvableNodes\":{"].iter().zip(&failed) {
        out.extend_from_slice(key);
        for (k, (name, r)) in list.iter().enumerate() {
            if k > 0 {
                out.push(b',');
            }
            push_name(&mut out, name, verbatim);
            out.push(b':');
            out.extend_from_slice(r.json());
        }
    }
    out.extend_from_slice(b"},\"Error\":\"\"}");
    out
}

/// The filter answer as the wire type.
pub fn filter_result(args: &ExtenderArgsRef<'_>, c: &Candidates<'_>, answers: &[Answer]) -> ExtenderFilterResult {
    let fits = |p: usize| matches!(answers.get(p), Some(Answer::Fits(..)));
    let mut out = ExtenderFilterResult::default();
    match &args.nodes {
        Some(list) => {
            let items = list.items.iter().enumerate().filter(|(p, _)| fits(*p)).map(|(_, n)| n.clone()).collect();
            out.nodes = Some(NodeList { metadata: list.metadata.clone(), items });
        }
        None => {
            out.node_names =
                Some(c.names.iter().enumerate().filter(|(p, _)| fits(*p)).map(|(_, n)| n.to_string()).collect())
        }
    }
    let (mut failed, mut unresolvable) = (FailedNodesMap::new(), FailedNodesMap::new());
    for p in c.unique() {
        if let (Some(Answer::No(r)), Some(n)) = (answers.get(p), c.names.get(p)) {
            let map = if r.unresolvable() { &mut unresolvable } else { &mut failed };
            map.insert(n.to_string(), r.text.clone());
        }
    }
    out.failed_nodes = failed;
    out.failed_and_unresolvable_nodes = unresolvable;
    out
}

/// The prioritize answer's JSON: `[{"Host":…,"Score":…},…]`, one entry per candidate in order.
pub fn priorities_json(names: &[&str], verbatim: bool, scores: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(names.iter().map(|n| n.len() + 24).sum::<usize>() + 2);
    out.push(b'[');
    for (i, (n, &s)) in names.iter().zip(scores).enumerate() {
        if i > 0 {
            out.push(b',');
        }
        out.extend_from_slice(b"{\"Host\":");
        push_name(&mut out, n, verbatim);
        out.extend_from_slice(b",\"Score\":");
        push_score(&mut out, s);
        out.push(b'}');
    }
    out.push(b']');
    out
}

/// The prioritize answer as the wire type.
pub fn priorities(names: &[&str], scores: &[u8]) -> HostPriorityList {
    names.iter().zip(scores).map(|(n, &s)| HostPriority::new(*n, i64::from(s))).collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::extender::args_decoder::decode_args;
    use crate::scheduler::verdict_cache::RejectClass;

    #[test]
    fn scores_are_written_as_numbers() {
        for s in 0..=10u8 {
            let mut out = Vec::new();
            push_score(&mut out, s);
            assert_eq!(out, s.to_string().into_bytes());
        }
    }

    #[test]
    fn encoded_filter_answers_decode_to_the_wire_type() {
        let body = br#"{"Pod":{},"NodeNames":["a","b","a","c","we\"ird","b"]}"#;
        let args = decode_args(body).unwrap();
        let c = Candidates::unresolved(args.candidate_names().unwrap());
        let no = Arc::new(Reason::new(RejectClass::Preemptable, "busy \"now\"".into()));
        let never = Arc::new(Reason::new(RejectClass::Unresolvable, "too small".into()));
        let answers = vec![
            Answer::Fits(3, 0.3),
            Answer::No(no.clone()),
            Answer::Fits(3, 0.3),
            Answer::No(never),
            Answer::Fits(0, 0.0),
            Answer::No(no),
        ];
        let json = filter_json(&args, &c, &answers);
        let decoded: ExtenderFilterResult = serde_json::from_slice(&json).unwrap();
        assert_eq!(decoded, filter_result(&args, &c, &answers));
        assert_eq!(decoded.node_names.unwrap(), ["a", "a", "we\"ird"]);
        assert_eq!(decoded.failed_nodes.len(), 1, "b once");
        let names = ["a", "b"];
        for verbatim in [false, true] {
            let list: HostPriorityList = serde_json::from_slice(&priorities_json(&names, verbatim, &[10, 0])).unwrap();
            assert_eq!(list, priorities(&names, &[10, 0]));
        }
        // names taken from the body as they were written
        let plain = decode_args(br#"{"Pod":{},"NodeNames":["a","b"]}"#).unwrap();
        assert!(plain.names_verbatim());
        let c = Candidates::unresolved(plain.candidate_names().unwrap());
        let answers = [Answer::Fits(1, 0.1), Answer::No(Arc::new(Reason::new(RejectClass::Preemptable, "x".into())))];
        let json = filter_json(&plain, &c, &answers);
        assert_eq!(
            String::from_utf8(json).unwrap(),
            r#"{"Nodes":null,"NodeNames":["a"],"FailedNodes":{"b":"x"},"FailedAndUnresolvableNodes":{},"Error":""}"#
        );
        assert!(!args.names_verbatim(), "an escaped name was copied");
    }
}
