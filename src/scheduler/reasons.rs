//! The texts kube-scheduler shows from gpuplace: filter reasons (one per rejected node) and the
//! `Error` of filter and bind answers.
//!
//! kube-scheduler counts the nodes that gave identical reason texts and writes "0/16 nodes are
//! available: 12 `<reason>`, 4 `<reason>`." into the pod's `FailedScheduling` event, which the API
//! server refuses beyond 1,024 characters; and it uses the text as a format string, so a `%` comes
//! out garbled (`30%!f(MISSING)ree`). So a reason depends only on the pod's request and the kind of
//! shortfall ([`Cause`]), never on the node's own figures, and no text that reaches kube-scheduler
//! contains `%`. The node's figures go to the placement log and debug logs instead
//! (docs/extender-protocol.md, "Reasons").

use crate::placement::feasibility::Cause;
use crate::scheduler::input::NodeObject;
use gpuplace_core::annotations::ANNOTATION_INVENTORY;
use gpuplace_core::resources::RESOURCE_GPU;

/// Every reason we give kube-scheduler starts with this, so a person reading the pod's events knows
/// which component turned the node down.
pub const REASON_PREFIX: &str = "gpuplace: ";

/// At most this many rejected nodes of one filter get their detail written (placement log, debug
/// log): enough to see why, bounded in a cluster of thousands.
pub const MAX_DETAILED_NODES: usize = 32;

/// `reason` as kube-scheduler gets it: prefixed, without `%`.
pub fn prefixed(reason: &str) -> String {
    scrub(format!("{REASON_PREFIX}{reason}"))
}

/// `text` with every `%` written out as "percent" (kube-scheduler formats reasons and errors with
/// Go's `fmt`, where a bare `%` starts a verb). Texts without one are returned as they are.
pub fn scrub(text: String) -> String {
    if !text.contains('%') {
        return text;
    }
    let mut out = String::with_capacity(text.len() + 16);
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        if out.chars().next_back().is_some_and(|p| !p.is_whitespace()) {
            out.push(' ');
        }
        out.push_str("percent");
        if chars.peek().is_some_and(|n| n.is_alphanumeric()) {
            out.push(' ');
        }
    }
    out
}

/// The reason for a node the engine rejected: its cause's text, or (when the engine could not say,
/// which the classification makes unexpected) whether preemption might help.
pub(crate) fn rejection(cause: Option<Cause>, unresolvable: bool) -> String {
    match cause {
        Some(c) => prefixed(&c.to_string()),
        None if unresolvable => prefixed("does not fit (never fits)"),
        None => prefixed("does not fit (might fit after preemption)"),
    }
}

/// Why a candidate gpuplace has no GPU inventory for is turned down.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum UnknownNode {
    /// Names only, or a Node object without the annotation that gpuplace's cache does not know.
    NotCached,
    /// Its Node object advertises no gpuplace resource: not a GPU node of ours.
    NotGpuNode,
    /// Its Node object advertises the GPU resource but carries no valid inventory annotation.
    NoInventory,
}

impl UnknownNode {
    pub const ALL: [UnknownNode; 3] = [UnknownNode::NotCached, UnknownNode::NotGpuNode, UnknownNode::NoInventory];

    /// From the candidate's Node object, when kube-scheduler sent it.
    pub fn of(object: Option<&NodeObject<'_>>) -> Self {
        match object {
            None => UnknownNode::NotCached,
            Some(n) if !n.advertises_gpus => UnknownNode::NotGpuNode,
            Some(_) => UnknownNode::NoInventory,
        }
    }

    /// What kube-scheduler is told (the same for every such node).
    pub fn reason(self) -> String {
        prefixed(match self {
            UnknownNode::NotCached => "node not in gpuplace's node cache, its GPUs are unknown",
            UnknownNode::NotGpuNode => "not a gpuplace GPU node (no inventory, no gpuplace.io/gpu)",
            UnknownNode::NoInventory => "no valid gpuplace.io/inventory annotation on the node",
        })
    }

    /// The same for logs, naming the node.
    pub fn detail(self, name: &str) -> String {
        match self {
            UnknownNode::NotCached => format!("node {name} is not in gpuplace's node cache, so its GPUs are unknown"),
            UnknownNode::NotGpuNode => format!(
                "node {name} has no {ANNOTATION_INVENTORY} annotation and advertises no {RESOURCE_GPU}: not a gpuplace GPU node"
            ),
            UnknownNode::NoInventory => format!(
                "node {name} has no valid {ANNOTATION_INVENTORY} annotation (the device plugin publishes it) and is not in gpuplace's node cache, so its GPUs are unknown"
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percent_signs_are_written_out() {
        for (text, want) in [
            ("no percent here", "no percent here"),
            ("30% free", "30 percent free"),
            (
                "is 150% per GPU, more than one GPU (100%); ask",
                "is 150 percent per GPU, more than one GPU (100 percent); ask",
            ),
            ("100 % of it", "100 percent of it"),
            ("%d and 5%s", "percent d and 5 percent s"),
            ("%", "percent"),
            ("%%", "percent percent"),
        ] {
            assert_eq!(scrub(text.to_string()), want, "{text}");
        }
        assert!(!prefixed("a%b%").contains('%'));
    }

    #[test]
    fn unknown_node_reasons_name_no_node() {
        for u in UnknownNode::ALL {
            let r = u.reason();
            assert!(r.starts_with(REASON_PREFIX) && r.len() < 80 && !r.contains('%'), "{r}");
            assert!(u.detail("gpu-node-7").contains("gpu-node-7"));
        }
    }
}
