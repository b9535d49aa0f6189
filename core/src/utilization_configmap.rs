//! Where live utilization travels: one ConfigMap per node, written by the device plugin and watched
//! by the extender (docs/contracts.md). Not on the Node object: every Node update makes
//! kube-scheduler move every unschedulable pod back to its active queue, and utilization changes
//! every few seconds; kube-scheduler does not watch ConfigMaps.
//!
//! The value is the versioned [`UtilizationAnnotation`](super::annotations::UtilizationAnnotation)
//! JSON, unchanged. The ConfigMap's name is derived from the node's name
//! ([`configmap_name`]), so a reader checks that the two agree and one node has exactly one
//! ConfigMap. Plain data: the Kubernetes calls are in the device plugin and `src/apiserver/`.

use std::collections::BTreeMap;

/// The namespace of the utilization ConfigMaps unless `--utilization-namespace` says otherwise: one
/// of their own, so that the device plugins' create and patch there reach no other ConfigMap
/// (scheduler-config/device-plugin/namespace.yaml).
pub const DEFAULT_UTILIZATION_NAMESPACE: &str = "gpuplace-utilization";

/// Label on every utilization ConfigMap, with value `"true"`: what the extender's watch selects.
pub const LABEL_UTILIZATION: &str = "gpuplace.io/utilization";
/// The label selector of the extender's watch.
pub const UTILIZATION_SELECTOR: &str = "gpuplace.io/utilization=true";
/// `app.kubernetes.io/managed-by` on the ConfigMaps, naming the writer.
pub const MANAGED_BY: &str = "gpuplace-device-plugin";
/// Data key: the node's name.
pub const KEY_NODE: &str = "node";
/// Data key: the [`UtilizationAnnotation`](super::annotations::UtilizationAnnotation) JSON.
pub const KEY_UTILIZATION: &str = "utilization";

const PREFIX: &str = "gpuplace-utilization-";
/// A ConfigMap's name is a DNS subdomain: at most 253 characters.
const MAX_NAME: usize = 253;
/// Hex digits of the hash that stands in for a truncated tail.
const HASH_DIGITS: usize = 10;

/// Why a ConfigMap was not taken as a node's utilization.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UtilizationConfigMapError {
    #[error("utilization ConfigMap {name}: no {KEY_NODE:?} key in its data")]
    NoNode { name: String },
    #[error("utilization ConfigMap {name}: no {KEY_UTILIZATION:?} key in its data")]
    NoValue { name: String },
    #[error("utilization ConfigMap {name}: names node {node:?}, whose ConfigMap is {expected}")]
    WrongName { name: String, node: String, expected: String },
}

/// `gpuplace-utilization-<node>`; a name that would exceed 253 characters keeps as much of the node's
/// name as fits and ends in a hash of the whole name, so distinct nodes keep distinct ConfigMaps.
/// Node names are DNS subdomains, and so is the result (a cut never leaves an empty label).
pub fn configmap_name(node: &str) -> String {
    if PREFIX.len() + node.len() <= MAX_NAME {
        return format!("{PREFIX}{node}");
    }
    let keep = MAX_NAME - PREFIX.len() - 1 - HASH_DIGITS;
    // node names are ASCII; a char boundary keeps a malformed one from panicking all the same
    let mut cut = keep;
    while !node.is_char_boundary(cut) {
        cut -= 1;
    }
    let head = node[..cut].trim_end_matches(['.', '-']);
    let hash = format!("{:016x}", fnv1a(node.as_bytes()));
    format!("{PREFIX}{head}-{}", &hash[..HASH_DIGITS])
}

/// FNV-1a, 64 bits: stable across Rust versions and builds (the device plugin and the extender may be
/// built apart), unlike `std`'s default hasher.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3))
}

/// The ConfigMap's labels.
pub fn labels() -> BTreeMap<String, String> {
    [(LABEL_UTILIZATION, "true"), ("app.kubernetes.io/managed-by", MANAGED_BY)]
        .into_iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// The ConfigMap's data for `node` and a utilization JSON value.
pub fn data(node: &str, value_json: String) -> BTreeMap<String, String> {
    [(KEY_NODE.to_string(), node.to_string()), (KEY_UTILIZATION.to_string(), value_json)].into_iter().collect()
}

/// The node and the utilization JSON of the ConfigMap `name` (the JSON is parsed by the reader).
pub fn read<'a>(
    name: &str,
    data: Option<&'a BTreeMap<String, String>>,
) -> Result<(&'a str, &'a str), UtilizationConfigMapError> {
    let node =
        data.and_then(|d| d.get(KEY_NODE)).ok_or_else(|| UtilizationConfigMapError::NoNode { name: name.into() })?;
    let expected = configmap_name(node);
    if expected != name {
        return Err(UtilizationConfigMapError::WrongName { name: name.into(), node: node.clone(), expected });
    }
    let value = data
        .and_then(|d| d.get(KEY_UTILIZATION))
        .ok_or_else(|| UtilizationConfigMapError::NoValue { name: name.into() })?;
    Ok((node, value))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn is_dns_subdomain(s: &str) -> bool {
        s.len() <= 253
            && s.split('.').all(|label| {
                let b = label.as_bytes();
                !b.is_empty()
                    && b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-')
                    && b[0].is_ascii_alphanumeric()
                    && b[b.len() - 1].is_ascii_alphanumeric()
            })
    }

    #[test]
    fn short_names_are_prefixed_and_long_ones_cut_with_a_hash() {
        assert_eq!(configmap_name("gpu-node-7"), "gpuplace-utilization-gpu-node-7");
        // exactly fits: kept whole
        let fits = "a".repeat(253 - PREFIX.len());
        assert_eq!(configmap_name(&fits), format!("{PREFIX}{fits}"));
        // one more: cut, hashed, 253 long
        let long = format!("{fits}b");
        let name = configmap_name(&long);
        assert_eq!(name.len(), 253);
        assert!(is_dns_subdomain(&name), "{name}");
        // two nodes sharing the kept head differ by their hash
        let other = format!("{fits}c");
        assert_ne!(configmap_name(&other), name);
        assert_eq!(configmap_name(&long), name, "stable");
        // a cut that lands after a dot never leaves an empty label
        let dotted = format!("{}.{}", "x".repeat(220), "y".repeat(32));
        let name = configmap_name(&dotted);
        assert!(is_dns_subdomain(&name) && name.len() <= 253, "{name}");
        // the longest legal node name
        let max = ["a".repeat(63), "b".repeat(63), "c".repeat(63), "d".repeat(61)].join(".");
        assert_eq!(max.len(), 253);
        assert!(is_dns_subdomain(&configmap_name(&max)));
        // FNV-1a's published test vector: the hash must never change between builds
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn read_checks_the_node_against_the_name() {
        let d = data("n1", "{}".into());
        assert_eq!(read("gpuplace-utilization-n1", Some(&d)), Ok(("n1", "{}")));
        assert!(matches!(read("gpuplace-utilization-n2", Some(&d)), Err(UtilizationConfigMapError::WrongName { .. })));
        assert!(matches!(read("x", None), Err(UtilizationConfigMapError::NoNode { .. })));
        let mut no_value = d.clone();
        no_value.remove(KEY_UTILIZATION);
        let e = read("gpuplace-utilization-n1", Some(&no_value)).unwrap_err();
        assert!(e.to_string().contains("no \"utilization\" key"), "{e}");
        assert_eq!(labels()[LABEL_UTILIZATION], "true");
        assert_eq!(UTILIZATION_SELECTOR, format!("{LABEL_UTILIZATION}=true"));
    }
}
