//! What a pod requires of its node that gpuplace can see, judged with kube-scheduler's rules:
//! - `spec.nodeSelector` and the required node affinity (`requiredDuringSchedulingIgnoredDuringExecution`),
//!   on the node's name and labels (NodeAffinity plugin): every `nodeSelector` pair must match, and
//!   at least one term of the required affinity, a term matching when all of its expressions and
//!   fields do. A term with neither matches no node; `matchFields` knows `metadata.name` only.
//! - `spec.tolerations` against the node's taints (TaintToleration plugin): every `NoSchedule` and
//!   `NoExecute` taint must be tolerated (`PreferNoSchedule` only weighs). A cordoned node carries
//!   `node.kubernetes.io/unschedulable:NoSchedule`, so this also covers NodeUnschedulable.
//!
//! Bind checks the node it is asked for against these, so that a bind from anyone but
//! kube-scheduler's own cycle cannot put a pod where kube-scheduler never would. Plain data, no I/O.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A selector operator (`NodeSelectorOperator`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Operator {
    In,
    NotIn,
    Exists,
    DoesNotExist,
    Gt,
    Lt,
}

/// One `NodeSelectorRequirement`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Requirement {
    pub key: String,
    pub operator: Operator,
    #[serde(default)]
    pub values: Vec<String>,
}

/// One `NodeSelectorTerm`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Term {
    #[serde(default)]
    pub match_expressions: Vec<Requirement>,
    #[serde(default)]
    pub match_fields: Vec<Requirement>,
}

/// A node's taint (`spec.taints[]`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Taint {
    pub key: String,
    #[serde(default)]
    pub value: String,
    /// `NoSchedule`, `PreferNoSchedule` or `NoExecute`.
    pub effect: String,
}

/// A pod's toleration (`spec.tolerations[]`). Empty fields are not written, so a pod read and
/// written again carries nothing the API did not send.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Toleration {
    /// Empty with `Exists`: every key.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub key: String,
    /// `Equal` (the default) or `Exists`.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub operator: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub value: String,
    /// Empty: every effect.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub effect: String,
}

impl Toleration {
    /// kube's `Toleration.ToleratesTaint`.
    pub fn tolerates(&self, t: &Taint) -> bool {
        if !self.effect.is_empty() && self.effect != t.effect {
            return false;
        }
        if !self.key.is_empty() && self.key != t.key {
            return false;
        }
        match self.operator.as_str() {
            "Exists" => true,
            "" | "Equal" => self.value == t.value,
            _ => false,
        }
    }
}

/// The pod's hard node constraints.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeConstraints {
    pub node_selector: BTreeMap<String, String>,
    /// `None`: no required node affinity.
    pub required_terms: Option<Vec<Term>>,
    pub tolerations: Vec<Toleration>,
}

impl Requirement {
    fn matches(&self, value: Option<&str>) -> bool {
        let number = |s: &str| s.parse::<i64>().ok();
        match self.operator {
            Operator::In => value.is_some_and(|v| self.values.iter().any(|x| x == v)),
            Operator::NotIn => value.is_none_or(|v| self.values.iter().all(|x| x != v)),
            Operator::Exists => value.is_some(),
            Operator::DoesNotExist => value.is_none(),
            // exactly one integer value, compared with the label's (kube's labels.Requirement)
            Operator::Gt | Operator::Lt => {
                let (Some(v), [bound]) = (value.and_then(number), self.values.as_slice()) else { return false };
                let Some(bound) = number(bound) else { return false };
                if self.operator == Operator::Gt {
                    v > bound
                } else {
                    v < bound
                }
            }
        }
    }
}

impl Term {
    fn matches(&self, node: &str, labels: &BTreeMap<String, String>) -> bool {
        if self.match_expressions.is_empty() && self.match_fields.is_empty() {
            return false;
        }
        self.match_expressions.iter().all(|r| r.matches(labels.get(&r.key).map(String::as_str)))
            && self.match_fields.iter().all(|r| r.key == "metadata.name" && r.matches(Some(node)))
    }
}

impl NodeConstraints {
    /// From the pod's `nodeSelector` and `affinity` (the JSON object, as the API has it); no
    /// tolerations (see [`with_tolerations`](Self::with_tolerations)).
    pub fn new(node_selector: BTreeMap<String, String>, affinity: Option<&serde_json::Value>) -> Result<Self, String> {
        let required = affinity
            .and_then(|a| a.get("nodeAffinity"))
            .and_then(|n| n.get("requiredDuringSchedulingIgnoredDuringExecution"))
            .filter(|r| !r.is_null());
        let required_terms = match required {
            None => None,
            Some(r) => {
                let terms = r.get("nodeSelectorTerms").cloned().unwrap_or(serde_json::Value::Array(Vec::new()));
                let terms = if terms.is_null() { serde_json::Value::Array(Vec::new()) } else { terms };
                Some(
                    serde_json::from_value::<Vec<Term>>(terms)
                        .map_err(|e| format!("spec.affinity.nodeAffinity's required terms cannot be read: {e}"))?,
                )
            }
        };
        Ok(Self { node_selector, required_terms, tolerations: Vec::new() })
    }

    /// These constraints with the pod's `tolerations`.
    pub fn with_tolerations(self, tolerations: Vec<Toleration>) -> Self {
        Self { tolerations, ..self }
    }

    /// `Ok` when node `name` with `labels` and `taints` satisfies every constraint; else which one
    /// it does not.
    pub fn admits(&self, name: &str, labels: &BTreeMap<String, String>, taints: &[Taint]) -> Result<(), String> {
        if let Some((k, v)) = self.node_selector.iter().find(|(k, v)| labels.get(*k) != Some(*v)) {
            return Err(format!("node {name} does not match the pod's nodeSelector {k}={v}"));
        }
        let hard = |t: &&Taint| t.effect == "NoSchedule" || t.effect == "NoExecute";
        if let Some(t) = taints.iter().filter(hard).find(|t| !self.tolerations.iter().any(|tol| tol.tolerates(t))) {
            let value = if t.value.is_empty() { String::new() } else { format!("={}", t.value) };
            return Err(format!(
                "node {name} has the taint {}{value}:{}, which the pod does not tolerate",
                t.key, t.effect
            ));
        }
        match &self.required_terms {
            Some(terms) if !terms.iter().any(|t| t.matches(name, labels)) => {
                Err(format!("node {name} matches none of the pod's required node affinity terms"))
            }
            _ => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    fn with_affinity(terms: serde_json::Value) -> NodeConstraints {
        let a =
            json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": terms}}});
        NodeConstraints::new(BTreeMap::new(), Some(&a)).unwrap()
    }

    #[test]
    fn no_constraints_admit_every_node() {
        let c = NodeConstraints::new(BTreeMap::new(), None).unwrap();
        assert_eq!(c.admits("n", &BTreeMap::new(), &[]), Ok(()));
        // preferred affinity only: nothing required
        let a = json!({"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": []}});
        assert_eq!(NodeConstraints::new(BTreeMap::new(), Some(&a)).unwrap(), c);
    }

    #[test]
    fn every_node_selector_pair_must_match() {
        let c = NodeConstraints::new(labels(&[("pool", "a"), ("zone", "z1")]), None).unwrap();
        assert_eq!(c.admits("n", &labels(&[("pool", "a"), ("zone", "z1"), ("x", "y")]), &[]), Ok(()));
        let e = c.admits("n", &labels(&[("pool", "a"), ("zone", "z2")]), &[]).unwrap_err();
        assert_eq!(e, "node n does not match the pod's nodeSelector zone=z1");
        assert!(c.admits("n", &BTreeMap::new(), &[]).is_err());
    }

    #[test]
    fn required_terms_are_ored_and_their_expressions_anded() {
        let c = with_affinity(json!([
            {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100", "a100"]},
                                  {"key": "spot", "operator": "DoesNotExist"}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["special"]}]},
        ]));
        assert_eq!(c.admits("n", &labels(&[("gpu", "h100")]), &[]), Ok(()));
        assert!(c.admits("n", &labels(&[("gpu", "h100"), ("spot", "1")]), &[]).is_err());
        assert!(c.admits("n", &labels(&[("gpu", "t4")]), &[]).is_err());
        assert_eq!(c.admits("special", &BTreeMap::new(), &[]), Ok(()));
        let e = c.admits("other", &BTreeMap::new(), &[]).unwrap_err();
        assert_eq!(e, "node other matches none of the pod's required node affinity terms");
    }

    #[test]
    fn operators_follow_kube() {
        let one = |op: &str, values: serde_json::Value| {
            with_affinity(json!([{"matchExpressions": [{"key": "k", "operator": op, "values": values}]}]))
        };
        let on = |c: &NodeConstraints, v: Option<&str>| {
            let l = v.map(|v| labels(&[("k", v)])).unwrap_or_default();
            c.admits("n", &l, &[]).is_ok()
        };
        let not_in = one("NotIn", json!(["a"]));
        assert!(on(&not_in, Some("b")) && on(&not_in, None) && !on(&not_in, Some("a")));
        let exists = one("Exists", json!([]));
        assert!(on(&exists, Some("")) && !on(&exists, None));
        let gt = one("Gt", json!(["8"]));
        assert!(on(&gt, Some("9")) && !on(&gt, Some("8")) && !on(&gt, Some("x")) && !on(&gt, None));
        let lt = one("Lt", json!(["8"]));
        assert!(on(&lt, Some("-1")) && !on(&lt, Some("8")));
        assert!(!on(&one("Gt", json!(["1", "2"])), Some("9")), "Gt takes exactly one value");
    }

    #[test]
    fn empty_terms_match_nothing_and_unreadable_ones_are_an_error() {
        assert!(with_affinity(json!([{}])).admits("n", &BTreeMap::new(), &[]).is_err());
        assert!(with_affinity(json!([])).admits("n", &BTreeMap::new(), &[]).is_err());
        let fields =
            with_affinity(json!([{"matchFields": [{"key": "spec.unschedulable", "operator": "In", "values": ["n"]}]}]));
        assert!(fields.admits("n", &BTreeMap::new(), &[]).is_err(), "only metadata.name is a field");
        let bad = json!({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{"matchExpressions": [{"key": "k", "operator": "Near"}]}]}}});
        assert!(NodeConstraints::new(BTreeMap::new(), Some(&bad)).is_err());
    }

    fn taint(key: &str, value: &str, effect: &str) -> Taint {
        Taint { key: key.into(), value: value.into(), effect: effect.into() }
    }

    fn tol(key: &str, operator: &str, value: &str, effect: &str) -> Toleration {
        Toleration { key: key.into(), operator: operator.into(), value: value.into(), effect: effect.into() }
    }

    #[test]
    fn hard_taints_must_be_tolerated_as_kube_matches_them() {
        let none = NodeConstraints::default();
        let gpu = taint("nvidia.com/gpu", "", "NoSchedule");
        let gpu_only = [gpu.clone()];
        let e = none.admits("n", &BTreeMap::new(), &gpu_only).unwrap_err();
        assert_eq!(e, "node n has the taint nvidia.com/gpu:NoSchedule, which the pod does not tolerate");
        // PreferNoSchedule only weighs
        assert_eq!(none.admits("n", &BTreeMap::new(), &[taint("k", "v", "PreferNoSchedule")]), Ok(()));
        let with = |t: Vec<Toleration>| NodeConstraints::default().with_tolerations(t);
        let cordoned = taint("node.kubernetes.io/unschedulable", "", "NoSchedule");
        let spot = taint("spot", "yes", "NoExecute");
        let admits = |c: &NodeConstraints, taints: &[Taint]| c.admits("n", &BTreeMap::new(), taints).is_ok();
        assert!(admits(&with(vec![tol("nvidia.com/gpu", "Exists", "", "NoSchedule")]), &gpu_only));
        assert!(admits(&with(vec![tol("nvidia.com/gpu", "", "", "")]), &gpu_only), "Equal to an empty value");
        assert!(!admits(&with(vec![tol("nvidia.com/gpu", "Equal", "x", "")]), &gpu_only));
        assert!(!admits(&with(vec![tol("nvidia.com/gpu", "Exists", "", "NoExecute")]), &gpu_only), "other effect");
        assert!(
            admits(&with(vec![tol("", "Exists", "", "")]), &[gpu.clone(), cordoned.clone(), spot.clone()]),
            "tolerates all"
        );
        assert!(admits(&with(vec![tol("spot", "Equal", "yes", "NoExecute")]), std::slice::from_ref(&spot)));
        assert!(!admits(&with(vec![tol("spot", "Equal", "no", "NoExecute")]), &[spot]));
        let e = none.admits("n", &BTreeMap::new(), &[cordoned]).unwrap_err();
        assert!(e.contains("node.kubernetes.io/unschedulable:NoSchedule"), "{e}");
    }
}
