//! Label and field selectors as the API server parses them from `labelSelector` and `fieldSelector`.

use serde_json::Value;

/// A parsed `labelSelector` and `fieldSelector` pair; the empty selector matches everything.
#[derive(Clone, Debug, Default)]
pub(crate) struct Selector {
    labels: Vec<LabelReq>,
    fields: Vec<FieldReq>,
}

#[derive(Clone, Debug)]
enum LabelReq {
    Eq(String, String),
    NotEq(String, String),
    In(String, Vec<String>),
    NotIn(String, Vec<String>),
    Exists(String),
    NotExists(String),
}

#[derive(Clone, Debug)]
struct FieldReq {
    path: String,
    value: String,
    equal: bool,
}

impl Selector {
    /// Parses both selectors; an error is the message of a 400 Bad Request.
    pub(crate) fn parse(labels: Option<&str>, fields: Option<&str>) -> Result<Selector, String> {
        let mut sel = Selector::default();
        for term in split_terms(labels.unwrap_or("")) {
            sel.labels.push(parse_label(&term)?);
        }
        for term in split_terms(fields.unwrap_or("")) {
            sel.fields.push(parse_field(&term)?);
        }
        Ok(sel)
    }

    pub(crate) fn matches(&self, obj: &Value) -> bool {
        let labels = obj.pointer("/metadata/labels");
        let label = |k: &str| labels.and_then(|l| l.get(k)).and_then(Value::as_str);
        let labels_ok = self.labels.iter().all(|req| match req {
            LabelReq::Eq(k, v) => label(k) == Some(v.as_str()),
            LabelReq::NotEq(k, v) => label(k) != Some(v.as_str()),
            LabelReq::In(k, vs) => label(k).is_some_and(|l| vs.iter().any(|v| v == l)),
            LabelReq::NotIn(k, vs) => label(k).is_none_or(|l| vs.iter().all(|v| v != l)),
            LabelReq::Exists(k) => label(k).is_some(),
            LabelReq::NotExists(k) => label(k).is_none(),
        });
        labels_ok && self.fields.iter().all(|f| (field_value(obj, &f.path) == f.value) == f.equal)
    }
}

/// A field as the API server compares it: a dotted path, absent reads as "" (so
/// `spec.nodeName=` selects unbound pods), numbers and booleans as their JSON text.
fn field_value(obj: &Value, path: &str) -> String {
    let mut at = obj;
    for part in path.split('.') {
        match at.get(part) {
            Some(v) => at = v,
            None => return String::new(),
        }
    }
    match at {
        Value::String(s) => s.clone(),
        Value::Null => String::new(),
        other => other.to_string(),
    }
}

/// Splits on commas outside parentheses (`a in (x,y),b`).
fn split_terms(s: &str) -> Vec<String> {
    let mut terms = Vec::new();
    let mut depth = 0usize;
    let mut cur = String::new();
    for c in s.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                terms.push(std::mem::take(&mut cur));
                continue;
            }
            _ => {}
        }
        cur.push(c);
    }
    terms.push(cur);
    terms.into_iter().map(|t| t.trim().to_owned()).filter(|t| !t.is_empty()).collect()
}

fn parse_label(term: &str) -> Result<LabelReq, String> {
    let set = |rest: &str| -> Result<Vec<String>, String> {
        let inner = rest
            .trim()
            .strip_prefix('(')
            .and_then(|r| r.strip_suffix(')'))
            .ok_or_else(|| format!("unable to parse requirement: {term:?}: expected a (value,...) set"))?;
        Ok(inner.split(',').map(|v| v.trim().to_owned()).filter(|v| !v.is_empty()).collect())
    };
    if let Some(key) = term.strip_prefix('!') {
        return Ok(LabelReq::NotExists(key.trim().to_owned()));
    }
    if let Some((k, v)) = term.split_once("!=") {
        return Ok(LabelReq::NotEq(k.trim().to_owned(), v.trim().to_owned()));
    }
    if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
        return Ok(LabelReq::Eq(k.trim().to_owned(), v.trim().to_owned()));
    }
    if let Some((k, rest)) = term.split_once(" notin ") {
        return Ok(LabelReq::NotIn(k.trim().to_owned(), set(rest)?));
    }
    if let Some((k, rest)) = term.split_once(" in ") {
        return Ok(LabelReq::In(k.trim().to_owned(), set(rest)?));
    }
    if term.contains(char::is_whitespace) || term.contains(['(', ')']) {
        return Err(format!("unable to parse requirement: {term:?}"));
    }
    Ok(LabelReq::Exists(term.to_owned()))
}

fn parse_field(term: &str) -> Result<FieldReq, String> {
    let (path, value, equal) = if let Some((k, v)) = term.split_once("!=") {
        (k, v, false)
    } else if let Some((k, v)) = term.split_once("==").or_else(|| term.split_once('=')) {
        (k, v, true)
    } else {
        return Err(format!("invalid selector: {term:?}; can't understand it"));
    };
    Ok(FieldReq { path: path.trim().to_owned(), value: value.trim().to_owned(), equal })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod() -> Value {
        json!({"metadata": {"name": "p", "namespace": "ns", "labels": {"app": "web", "tier": "gpu"}},
               "spec": {"nodeName": "n1"}, "status": {"phase": "Running"}})
    }

    #[test]
    fn label_selectors() {
        let m = |l: &str| Selector::parse(Some(l), None).unwrap().matches(&pod());
        assert!(m("app=web"));
        assert!(m("app==web,tier"));
        assert!(!m("app!=web"));
        assert!(m("app in (db, web),!missing"));
        assert!(!m("app notin (web)"));
        assert!(m("missing notin (x)"));
        assert!(!m("missing"));
        assert!(m(""));
        assert!(Selector::parse(Some("app in web"), None).is_err());
    }

    #[test]
    fn field_selectors() {
        let m = |f: &str| Selector::parse(None, Some(f)).unwrap().matches(&pod());
        assert!(m("spec.nodeName=n1"));
        assert!(m("metadata.name=p,metadata.namespace==ns"));
        assert!(!m("spec.nodeName!=n1"));
        assert!(!m("spec.nodeName="));
        assert!(m("status.phase=Running"));
        assert!(m("spec.schedulerName="));
        assert!(Selector::parse(None, Some("spec.nodeName")).is_err());
    }
}
