//! gpuplace's own books: per node, the assignment of every pod gpuplace counts there, kept where
//! tenants cannot write (one ConfigMap per node in the extender's namespace, written by the leader:
//! `k8s::books`).
//!
//! A pod's `gpuplace.io/assignment` annotation is the record the device plugin reads, but anyone who
//! can patch the pod (its owner, a cluster admin, a webhook, a GitOps tool pruning annotations it
//! does not know) can remove or rewrite it. The signature stops forged records, not erased ones: a
//! rebuild from annotations alone would forget the GPUs of a running pod whose annotation was
//! stripped, and give them to the next pod (issue 48). A rebuild therefore also reads the books and
//! counts a running pod from them when its annotation is missing or not trusted, reporting the
//! tampering; the leader then writes the record back on the pod.
//!
//! Pure: names, the ConfigMap's data layout, and which nodes' books are due a write.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::{Deserialize, Serialize};

/// Name prefix of the books' ConfigMaps (`gpuplace-books-<node>`).
pub const BOOKS_PREFIX: &str = "gpuplace-books-";
/// Label on every books ConfigMap (value `"true"`), what the rebuild lists them by.
pub const BOOKS_LABEL: &str = "gpuplace.io/books";
/// The data key holding the node's name (the rest are pod UIDs, which never read `node`).
pub const NODE_KEY: &str = "node";
/// The longest object name the API server takes (a DNS subdomain).
const MAX_NAME: usize = 253;

/// One pod's record in its node's book.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BookEntry {
    /// `namespace/name`.
    pub pod: String,
    /// The signed `gpuplace.io/assignment` text, as bind wrote it (or the leader re-signed it).
    pub assignment: String,
}

/// A node's book: pod UID → its record.
pub type NodeBook = BTreeMap<String, BookEntry>;

/// The ConfigMap name of `node`'s book: the prefix and the node's name, or, for a name too long for
/// that, its first characters and a stable hash of the whole (node names are DNS subdomains already).
pub fn books_name(node: &str) -> String {
    let plain = format!("{BOOKS_PREFIX}{node}");
    if plain.len() <= MAX_NAME {
        return plain;
    }
    let hash = format!("{:016x}", fnv1a(node.as_bytes()));
    let keep = MAX_NAME - BOOKS_PREFIX.len() - hash.len() - 1;
    // DNS subdomains are ASCII, so any byte index is a char boundary; trimmed so a '.' or '-' does not
    // end up beside the separator
    let head = node.get(..keep).unwrap_or(node).trim_end_matches(['.', '-']);
    format!("{BOOKS_PREFIX}{head}-{hash}")
}

/// FNV-1a, 64 bits: stable across processes and versions (std's hasher is seeded at random).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3))
}

/// The ConfigMap's `data` for `node`'s book.
pub fn encode(node: &str, book: &NodeBook) -> BTreeMap<String, String> {
    let mut data = BTreeMap::new();
    data.insert(NODE_KEY.to_string(), node.to_string());
    for (uid, entry) in book {
        // a struct of two strings always serializes
        if let Ok(text) = serde_json::to_string(entry) {
            data.insert(uid.clone(), text);
        }
    }
    data
}

/// Why a books ConfigMap could not be read whole.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BooksError {
    #[error("the books ConfigMap names no node (data key `{NODE_KEY}`)")]
    NoNode,
    #[error("the record of pod UID {uid} is not readable: {why}")]
    Entry { uid: String, why: String },
}

/// A books ConfigMap's `data` read back: the node, its book, and the entries that could not be read
/// (skipped: the rest of the book still counts).
pub fn decode(data: &BTreeMap<String, String>) -> Result<(String, NodeBook, Vec<BooksError>), BooksError> {
    let node = data.get(NODE_KEY).filter(|n| !n.is_empty()).ok_or(BooksError::NoNode)?;
    let mut book = NodeBook::new();
    let mut bad = Vec::new();
    for (uid, text) in data.iter().filter(|(k, _)| k.as_str() != NODE_KEY) {
        match serde_json::from_str::<BookEntry>(text) {
            Ok(entry) => {
                book.insert(uid.clone(), entry);
            }
            Err(e) => bad.push(BooksError::Entry { uid: uid.clone(), why: e.to_string() }),
        }
    }
    Ok((node.clone(), book, bad))
}

/// What the books hold, by pod UID, for a rebuild.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KeptRecords {
    by_uid: HashMap<String, (String, BookEntry)>,
}

impl KeptRecords {
    /// From every node's book. A UID in two books (a pod's record moved with a node renamed, never by
    /// gpuplace) keeps the first; the rebuild checks it against the pod's node anyway.
    pub fn from_books(books: impl IntoIterator<Item = (String, NodeBook)>) -> Self {
        let mut by_uid = HashMap::new();
        for (node, book) in books {
            for (uid, entry) in book {
                by_uid.entry(uid).or_insert_with(|| (node.clone(), entry));
            }
        }
        Self { by_uid }
    }

    /// The record kept for pod `uid` on `node` (a record of another node is not this pod's placement).
    pub fn get(&self, uid: &str, node: &str) -> Option<&BookEntry> {
        self.by_uid.get(uid).filter(|(n, _)| n == node).map(|(_, e)| e)
    }

    pub fn len(&self) -> usize {
        self.by_uid.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_uid.is_empty()
    }
}

/// The books' part of the scheduler's state: which nodes' books are due a write, and the pods whose
/// annotation no longer carries their record (erased or rewritten after gpuplace bound them), for
/// the leader to write it back.
#[derive(Debug, Default)]
pub struct BooksState {
    /// Its own lock: the writer takes the marks under the state's read lock, whose write lock would
    /// drop every cached verdict.
    pub due: std::sync::Mutex<DueBooks>,
    pub tampered: HashSet<String>,
}

impl BooksState {
    /// Marks `node`'s book due (under the state's write lock).
    pub fn mark(&mut self, node: &str) {
        self.due.get_mut().unwrap_or_else(|e| e.into_inner()).mark(node);
    }

    pub fn mark_all(&mut self) {
        self.due.get_mut().unwrap_or_else(|e| e.into_inner()).mark_all();
    }

    /// After a rebuild: every book due, nothing to put back until the rebuild says so.
    pub fn reset(&mut self) {
        self.mark_all();
        self.tampered.clear();
    }
}

/// Which nodes' books may differ from what is counted: marked wherever a record is counted, changed or
/// released, taken by the leader's writer.
#[derive(Debug, Default)]
pub struct DueBooks {
    nodes: HashSet<String>,
    all: bool,
}

impl DueBooks {
    pub fn mark(&mut self, node: &str) {
        if !self.all && !self.nodes.contains(node) {
            self.nodes.insert(node.to_string());
        }
    }

    /// Every node (a rebuild, a new leader comparing with what is written).
    pub fn mark_all(&mut self) {
        self.all = true;
        self.nodes.clear();
    }

    /// The nodes due, or `None` for all of them; nothing is due afterwards.
    pub fn take(&mut self) -> Option<Option<HashSet<String>>> {
        if self.all {
            self.all = false;
            return Some(None);
        }
        if self.nodes.is_empty() {
            return None;
        }
        Some(Some(std::mem::take(&mut self.nodes)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(pod: &str) -> BookEntry {
        BookEntry { pod: pod.into(), assignment: format!("{{\"pod\":\"{pod}\"}}") }
    }

    #[test]
    fn a_book_reads_back_as_written() {
        let book = NodeBook::from([("uid-1".to_string(), entry("ns/a")), ("uid-2".to_string(), entry("ns/b"))]);
        let data = encode("gpu-00", &book);
        assert_eq!(data.len(), 3);
        let (node, back, bad) = decode(&data).expect("decodes");
        assert_eq!((node.as_str(), &back, bad.len()), ("gpu-00", &book, 0));
    }

    #[test]
    fn unreadable_entries_are_skipped_and_named_and_a_book_without_node_is_refused() {
        let mut data = encode("n", &NodeBook::from([("u".to_string(), entry("ns/a"))]));
        data.insert("bad".into(), "not json".into());
        let (_, book, bad) = decode(&data).expect("decodes");
        assert_eq!(book.len(), 1);
        assert!(matches!(&bad[..], [BooksError::Entry { uid, .. }] if uid == "bad"));
        data.remove(NODE_KEY);
        assert_eq!(decode(&data).unwrap_err(), BooksError::NoNode);
    }

    #[test]
    fn names_fit_the_api_servers_limit_and_stay_distinct() {
        assert_eq!(books_name("gpu-00"), "gpuplace-books-gpu-00");
        let long_a = format!("{}a", "x".repeat(300));
        let long_b = format!("{}b", "x".repeat(300));
        let (a, b) = (books_name(&long_a), books_name(&long_b));
        assert!(a.len() <= MAX_NAME && b.len() <= MAX_NAME, "{} {}", a.len(), b.len());
        assert_ne!(a, b);
        assert_eq!(a, books_name(&long_a), "stable");
        let dotted = format!("{}.{}", "y".repeat(237), "z".repeat(40));
        assert!(!books_name(&dotted).contains(".-"));
    }

    #[test]
    fn kept_records_answer_only_for_the_pods_node() {
        let kept = KeptRecords::from_books([("n1".to_string(), NodeBook::from([("u".to_string(), entry("ns/a"))]))]);
        assert_eq!(kept.get("u", "n1").map(|e| e.pod.as_str()), Some("ns/a"));
        assert!(kept.get("u", "n2").is_none());
        assert!(kept.get("v", "n1").is_none());
    }

    #[test]
    fn due_books_hand_out_each_mark_once() {
        let mut due = DueBooks::default();
        assert!(due.take().is_none());
        due.mark("a");
        due.mark("a");
        assert_eq!(due.take(), Some(Some(HashSet::from(["a".to_string()]))));
        assert!(due.take().is_none());
        due.mark("b");
        due.mark_all();
        due.mark("c");
        assert_eq!(due.take(), Some(None));
        assert!(due.take().is_none());
    }
}
