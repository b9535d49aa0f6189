//! scheduler-config/monitoring/ on its own: the Grafana dashboard imports (uid, title, a Prometheus
//! data source variable used by every query), every alert has a severity, a summary, a description
//! and a section in docs/deploy.md, and the ServiceMonitor and PodMonitor select the extender's Service
//! and the device plugin's pods by their labels and port names. Also the PromQL scanner's and the
//! exposition parser's own tests. That every query names only series the binaries export is checked
//! against the running binaries by device-plugin/tests/monitoring.rs (it needs the device plugin's
//! fake pod-resources server, for the pod labels).

use std::collections::BTreeSet;
use std::path::PathBuf;

use promql_check::{dashboard, monitoring, sample_line, scan, yaml_documents};

#[path = "support/promql_check.rs"]
mod promql_check;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn the_scanner_finds_metrics_and_labels_and_skips_the_rest() {
    let r = scan(
        r#"histogram_quantile(0.99, sum by (verb, le) (rate(gpuplace_request_duration_seconds_bucket{verb!~"bind|x"}[$__rate_interval] offset 5m)))
           and on(instance) (gpuplace_ready == 1) > bool 0.5"#,
    )
    .unwrap();
    assert_eq!(
        r.metrics,
        vec![
            ("gpuplace_request_duration_seconds_bucket".to_string(), vec!["verb".to_string()]),
            ("gpuplace_ready".to_string(), vec![])
        ]
    );
    assert_eq!(r.grouping, ["verb", "le", "instance"]);
    let r = scan(r#"max by (Hostname, gpu) (DCGM_FI_DEV_XID_ERRORS{Hostname=~"$node", pod!=""}) > 0"#).unwrap();
    assert_eq!(r.metrics, vec![("DCGM_FI_DEV_XID_ERRORS".into(), vec!["Hostname".into(), "pod".into()])]);
    assert_eq!(r.grouping, ["Hostname", "gpu"]);
    // sum(x) by (l), group_left without labels, a recording rule's colons
    let r = scan("sum(a:b:rate5m) by (node) * on(node) group_left c").unwrap();
    assert_eq!(r.metrics.iter().map(|m| m.0.as_str()).collect::<Vec<_>>(), ["a:b:rate5m", "c"]);
    assert_eq!(r.grouping, ["node", "node"]);
    assert!(scan("rat(x[5m])").is_err(), "an unknown function");
    assert!(scan("sum(x").is_err(), "unbalanced");
    assert!(scan(r#"{__name__="x"}"#).is_err(), "no metric name");
    assert!(scan("1 + 1").is_err(), "no metric");
}

#[test]
fn exposition_lines_parse_with_escaped_values() {
    assert_eq!(
        sample_line(r#"a_total{x="q\"}",y="\\"} 3"#),
        Some(("a_total".to_string(), vec!["x".to_string(), "y".to_string()]))
    );
    assert_eq!(sample_line("gpuplace_ready 1"), Some(("gpuplace_ready".to_string(), vec![])));
    assert_eq!(sample_line("x{a=\"1\"} not-a-number"), None);
}

#[test]
fn the_dashboard_is_importable() {
    let d = dashboard(&root());
    assert_eq!(d["uid"].as_str(), Some("gpuplace-overview"));
    assert!(d["title"].as_str().is_some_and(|t| !t.is_empty()));
    assert!(d["schemaVersion"].as_u64().is_some_and(|v| v >= 30));
    let vars = d["templating"]["list"].as_array().expect("templating.list");
    assert!(
        vars.iter().any(|v| v["name"] == "datasource" && v["type"] == "datasource" && v["query"] == "prometheus"),
        "a Prometheus data source variable"
    );
    let panels = d["panels"].as_array().expect("panels");
    let mut ids = BTreeSet::new();
    for p in panels {
        let title = p["title"].as_str().unwrap_or_default();
        assert!(ids.insert(p["id"].as_u64().expect("panel id")), "duplicate id at {title}");
        for k in ["h", "w", "x", "y"] {
            assert!(p["gridPos"][k].is_u64(), "{title}: gridPos.{k}");
        }
        if p["type"] == "row" {
            continue;
        }
        assert_eq!(p["datasource"]["uid"].as_str(), Some("${datasource}"), "{title}");
        let targets = p["targets"].as_array().unwrap_or_else(|| panic!("{title}: targets"));
        assert!(!targets.is_empty(), "{title}: no query");
        for t in targets {
            assert_eq!(t["datasource"]["uid"].as_str(), Some("${datasource}"), "{title}");
            assert!(t["expr"].as_str().is_some_and(|e| !e.is_empty()) && t["refId"].is_string(), "{title}");
        }
    }
}

#[test]
fn every_rule_says_how_bad_and_what_to_do() {
    let docs = yaml_documents(&monitoring(&root()).join("prometheus-rules.yaml"));
    assert_eq!(docs[0]["kind"].as_str(), Some("PrometheusRule"));
    assert_eq!(docs[0]["apiVersion"].as_str(), Some("monitoring.coreos.com/v1"));
    let deploy = std::fs::read_to_string(root().join("docs/deploy.md")).unwrap();
    let mut names = BTreeSet::new();
    for g in docs[0]["spec"]["groups"].as_sequence().unwrap() {
        for r in g["rules"].as_sequence().unwrap() {
            let name = r["alert"].as_str().expect("only alerts");
            assert!(names.insert(name.to_string()), "{name} twice");
            assert!(
                matches!(r["labels"]["severity"].as_str(), Some("critical" | "warning" | "info")),
                "{name}: severity"
            );
            for a in ["summary", "description"] {
                assert!(r["annotations"][a].as_str().is_some_and(|t| t.len() > 10), "{name}: {a}");
            }
            // documented for the on-call reader
            assert!(deploy.contains(&format!("`{name}`")), "docs/deploy.md does not explain {name}");
        }
    }
}

/// The ServiceMonitor and PodMonitor select the extender's Service and the device plugin's pods, by
/// their labels and port names, in their namespace.
#[test]
fn the_monitors_select_both_binaries() {
    let docs = yaml_documents(&monitoring(&root()).join("servicemonitor.yaml"));
    let find = |kind: &str| docs.iter().find(|d| d["kind"].as_str() == Some(kind)).unwrap_or_else(|| panic!("{kind}"));
    let config = root().join("scheduler-config");
    let svc = yaml_documents(&config.join("extender/service.yaml")).remove(0);
    let ds = yaml_documents(&config.join("device-plugin/daemonset.yaml")).remove(0);

    let sm = find("ServiceMonitor");
    assert_eq!(sm["metadata"]["namespace"], svc["metadata"]["namespace"]);
    for (k, v) in sm["spec"]["selector"]["matchLabels"].as_mapping().expect("matchLabels") {
        assert_eq!(&svc["metadata"]["labels"][k.as_str().unwrap()], v, "the Service's labels");
    }
    let port = sm["spec"]["endpoints"][0]["port"].as_str().expect("port");
    assert!(
        svc["spec"]["ports"].as_sequence().unwrap().iter().any(|p| p["name"].as_str() == Some(port)),
        "the Service has no port {port}"
    );
    assert_eq!(sm["spec"]["endpoints"][0]["path"].as_str(), Some("/metrics"));

    let pm = find("PodMonitor");
    assert_eq!(pm["metadata"]["namespace"], ds["metadata"]["namespace"]);
    let pod_labels = &ds["spec"]["template"]["metadata"]["labels"];
    for (k, v) in pm["spec"]["selector"]["matchLabels"].as_mapping().expect("matchLabels") {
        assert_eq!(&pod_labels[k.as_str().unwrap()], v, "the DaemonSet's pod labels");
    }
    let port = pm["spec"]["podMetricsEndpoints"][0]["port"].as_str().expect("port");
    let ports = ds["spec"]["template"]["spec"]["containers"][0]["ports"].as_sequence().unwrap();
    assert!(ports.iter().any(|p| p["name"].as_str() == Some(port)), "the DaemonSet has no port {port}");
    assert_eq!(pm["spec"]["podMetricsEndpoints"][0]["path"].as_str(), Some("/metrics"));
}
