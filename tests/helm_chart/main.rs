//! The Helm chart `scheduler-config/helm/gpuplace/` and the plain manifests of `scheduler-config/`
//! never drift apart.
//!
//! - `helm lint --strict` passes with the default values, with TLS on, with `scheduler.mode=config`
//!   and with `devicePlugin.fakeTopology` set (and with every optional value set at once).
//! - `helm template gpuplace CHART --namespace gpuplace-system --kube-version 1.36.0` renders exactly
//!   the objects of [`DEFAULT_FILES`]; with `monitoring.enabled` and `namespace.create` also those of
//!   [`MONITORING_FILES`] and `extender/namespace.yaml`. Objects are compared as parsed JSON values
//!   keyed by apiVersion, kind, namespace and name: comments and key order are ignored, nothing else
//!   (the chart adds no label of its own). Every other YAML file of `scheduler-config/` is named in
//!   [`NOT_OBJECTS`] with what checks it instead.
//! - TLS: by default (`extender.tls.mode=selfIssued`) option A's kube-scheduler finds its
//!   certificate files where `kube-scheduler-config.yaml`'s stanza says; with your own certificates
//!   (`secret`) the Deployment gets exactly the arguments, volume and mount that
//!   `extender/deployment.yaml` has commented out in place of `--tls-ca-secret`; without TLS (`off`)
//!   neither, no certificates Role, and both scheduler configurations are
//!   `kube-scheduler-config-http.yaml`'s. A values file from before (`extender.tls.enabled`) is
//!   refused with what to set instead.
//! - `scheduler.mode=config`: one ConfigMap whose KubeSchedulerConfiguration is
//!   `kube-scheduler-config.yaml` (`-http.yaml` without TLS), the URL following the release namespace.
//! - `devicePlugin.fakeTopology`: the topology in a ConfigMap, mounted, `--fake-topology` on the
//!   command line, no `NVIDIA_*` environment; otherwise the plain DaemonSet.
//! - The chart's copy of the Grafana dashboard is `monitoring/grafana-dashboard.json`, byte for byte.
//! - The extender arguments the chart renders parse with `gpuplace serve`'s own definitions.
//!
//! Helm comes from `$GPUPLACE_HELM` (the binary), else from `../shared/kube/helm.xz`, unpacked once
//! into `target/tmp/helm/helm`. Without either the tests fail and say where to get Helm: they never
//! pass without running.

use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use serde::Deserialize;
use serde_json::{json, Value};
use yaml_files::yaml_files;

#[path = "../support/packages.rs"]
mod packages;
#[path = "../support/xz.rs"]
mod xz;
#[path = "../support/yaml_files.rs"]
mod yaml_files;

// issue 49: what enforces shares on the node (the guard, managed MPS, the isolation mode)
mod node_isolation;

/// The plain files (under `scheduler-config/`) that the default rendering reproduces, and nothing else.
const DEFAULT_FILES: &[&str] = &[
    "extender/admission-policy.yaml",
    "extender/records-policy.yaml",
    "extender/deployment.yaml",
    "extender/flowschema.yaml",
    "extender/networkpolicy.yaml",
    "extender/pdb.yaml",
    "extender/rbac.yaml",
    "extender/service.yaml",
    "device-plugin/admission-policy.yaml",
    "device-plugin/daemonset.yaml",
    "device-plugin/namespace.yaml",
    "device-plugin/networkpolicy.yaml",
    "device-plugin/rbac.yaml",
    "second-profile/gpuplace-scheduler.yaml",
];

/// Rendered with `monitoring.enabled=true` (the Prometheus operator's kinds, off by default so that
/// the default rendering needs no CRD).
const MONITORING_FILES: &[&str] = &["monitoring/servicemonitor.yaml", "monitoring/prometheus-rules.yaml"];

/// Rendered with `devicePlugin.dra.enabled=true` (DRA mode), beside [`DEFAULT_FILES`].
const DRA_FILE: &str = "device-plugin/dra.yaml";
/// Rendered with `devicePlugin.dra.allocator=gpuplace` too: the gate policy and the extender's DRA RBAC.
const DRA_GPUPLACE_FILE: &str = "dra/gpuplace-allocates.yaml";

/// Rendered with `namespace.create=true` (off by default: `helm install --create-namespace`).
const NAMESPACE_FILE: &str = "extender/namespace.yaml";

/// YAML files of `scheduler-config/` that are not objects the chart applies, and what checks them.
const NOT_OBJECTS: &[&str] = &[
    // scheduler.mode=config renders them into a ConfigMap (the_config_mode_is_the_reference_file)
    "kube-scheduler-config.yaml",
    "kube-scheduler-config-http.yaml",
    // kubeadm's ClusterConfiguration for option B, applied by kubeadm on the control-plane nodes
    "default-profile/kubeadm-cluster-configuration.yaml",
];

const NAMESPACE: &str = "gpuplace-system";

const WHERE_TO_GET: &str = "set GPUPLACE_HELM to a Helm 3 binary (https://github.com/helm/helm/releases, \
     v3.17 or later: the official release archive holds `helm`), or put helm.xz (xz-compressed Helm \
     binary) in ../shared/kube/ beside the repository";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn config_dir() -> PathBuf {
    repo().join("scheduler-config")
}

fn chart() -> PathBuf {
    config_dir().join("helm/gpuplace")
}

/// The Helm binary: `$GPUPLACE_HELM`, else `../shared/kube/helm.xz` unpacked once (per process:
/// the unpacked file is written under another name and renamed, so concurrent runs never see half
/// a binary).
fn helm() -> &'static Path {
    static HELM: OnceLock<PathBuf> = OnceLock::new();
    HELM.get_or_init(|| {
        if let Some(p) = std::env::var_os("GPUPLACE_HELM").filter(|p| !p.is_empty()) {
            let p = PathBuf::from(p);
            assert!(p.is_file(), "GPUPLACE_HELM={} is not a file; {WHERE_TO_GET}", p.display());
            return p;
        }
        let xz = repo().join("../shared/kube/helm.xz");
        assert!(xz.is_file(), "Helm was not found ({} is missing); {WHERE_TO_GET}", xz.display());
        xz::unpack(&xz, &PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("helm"), "helm")
    })
}

/// Runs Helm; panics with its output when it fails.
fn run_helm(args: &[String]) -> String {
    let out = Command::new(helm()).args(args).output().unwrap_or_else(|e| panic!("running helm: {e}"));
    let (stdout, stderr) = (String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "helm {}: {}\n{stdout}\n{stderr}", args.join(" "), out.status);
    format!("{stdout}{stderr}")
}

/// A value set: `--set`, `--set-string` or `--set-file` arguments.
fn values(sets: &[&str]) -> Vec<String> {
    sets.iter().flat_map(|s| ["--set".to_string(), s.to_string()]).collect()
}

/// A topology file for `devicePlugin.fakeTopology`: the shared H100 node when it is there, else a
/// small one written here (the chart does not read it; the test compares it as text and JSON).
fn topology_file() -> PathBuf {
    let shared = repo().join("../shared/topologies/hgx-h100-8.json");
    if shared.is_file() {
        return shared;
    }
    let p = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("helm-chart-topology.json");
    let text = json!({"name": "two-gpus", "gpus": [{"index": 0}, {"index": 1}], "links": []});
    fs::write(&p, serde_json::to_string_pretty(&text).unwrap() + "\n").expect("write the topology");
    p
}

fn fake_topology_values() -> Vec<String> {
    vec!["--set-file".to_string(), format!("devicePlugin.fakeTopology={}", topology_file().display())]
}

/// `helm template` in the namespace, with the test's Kubernetes version.
fn render_in(namespace: &str, args: &[String]) -> Vec<Value> {
    let mut all: Vec<String> = ["template", "gpuplace"].iter().map(|s| s.to_string()).collect();
    all.push(chart().display().to_string());
    all.extend(["--namespace", namespace, "--kube-version", "1.36.0"].iter().map(|s| s.to_string()));
    all.extend(args.iter().cloned());
    let out = Command::new(helm()).args(&all).output().unwrap_or_else(|e| panic!("running helm: {e}"));
    assert!(out.status.success(), "helm {}: {}\n{}", all.join(" "), out.status, String::from_utf8_lossy(&out.stderr));
    documents(&String::from_utf8(out.stdout).expect("UTF-8"), "helm template")
}

fn render(args: &[String]) -> Vec<Value> {
    render_in(NAMESPACE, args)
}

/// Every non-empty document of a YAML stream, as JSON.
fn documents(text: &str, origin: &str) -> Vec<Value> {
    let mut out = Vec::new();
    for (i, doc) in serde_norway::Deserializer::from_str(text).enumerate() {
        let v = serde_norway::Value::deserialize(doc).unwrap_or_else(|e| panic!("{origin} document {i}: {e}"));
        if v.is_null() {
            continue;
        }
        out.push(serde_json::to_value(&v).unwrap_or_else(|e| panic!("{origin} document {i}: {e}")));
    }
    out
}

fn plain_documents(file: &str) -> Vec<Value> {
    let path = config_dir().join(file);
    documents(&fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())), file)
}

/// apiVersion, kind, namespace/name: what identifies an object in a cluster.
fn key(v: &Value) -> String {
    let s = |x: &Value| x.as_str().unwrap_or("").to_string();
    format!(
        "{} {} {}/{}",
        s(&v["apiVersion"]),
        s(&v["kind"]),
        s(&v["metadata"]["namespace"]),
        s(&v["metadata"]["name"])
    )
}

fn by_key(docs: Vec<Value>, origin: &str) -> BTreeMap<String, Value> {
    let mut out = BTreeMap::new();
    for d in docs {
        let k = key(&d);
        assert!(d["kind"].is_string() && d["metadata"]["name"].is_string(), "{origin}: no kind or name: {d}");
        assert!(out.insert(k.clone(), d).is_none(), "{origin}: {k} twice");
    }
    out
}

fn plain_objects(files: &[&str]) -> BTreeMap<String, Value> {
    by_key(files.iter().flat_map(|f| plain_documents(f)).collect(), &files.join(", "))
}

/// Where two JSON values differ, one line per difference, with its path.
fn differences(path: &str, want: &Value, got: &Value, out: &mut Vec<String>) {
    match (want, got) {
        (Value::Object(a), Value::Object(b)) => {
            for k in a.keys().chain(b.keys().filter(|k| !a.contains_key(*k))) {
                let p = format!("{path}.{k}");
                match (a.get(k), b.get(k)) {
                    (Some(x), Some(y)) => differences(&p, x, y, out),
                    (Some(x), None) => out.push(format!("  {p}: missing in the chart (plain: {x})")),
                    (None, Some(y)) => out.push(format!("  {p}: only in the chart: {y}")),
                    (None, None) => unreachable!(),
                }
            }
        }
        (Value::Array(a), Value::Array(b)) if a.len() == b.len() => {
            for (i, (x, y)) in a.iter().zip(b).enumerate() {
                differences(&format!("{path}[{i}]"), x, y, out);
            }
        }
        _ if want != got => out.push(format!("  {path}:\n    plain: {want}\n    chart: {got}")),
        _ => {}
    }
}

/// Panics with a readable diff unless the rendered objects are exactly the plain ones.
fn assert_same_objects(what: &str, plain: &BTreeMap<String, Value>, rendered: &BTreeMap<String, Value>) {
    let mut report = Vec::new();
    for (k, want) in plain {
        match rendered.get(k) {
            None => report.push(format!("{k}: in the plain manifests, not rendered by the chart")),
            Some(got) => {
                let mut d = Vec::new();
                differences("", want, got, &mut d);
                if !d.is_empty() {
                    report.push(format!("{k} differs:\n{}", d.join("\n")));
                }
            }
        }
    }
    for k in rendered.keys().filter(|k| !plain.contains_key(*k)) {
        report.push(format!("{k}: rendered by the chart, not in the plain manifests"));
    }
    assert!(
        report.is_empty(),
        "{what}: the chart and the plain manifests differ (change both together):\n{}",
        report.join("\n")
    );
}

fn find<'a>(docs: &'a [Value], kind: &str, name: &str) -> &'a Value {
    let found: Vec<&Value> = docs.iter().filter(|d| d["kind"] == kind && d["metadata"]["name"] == name).collect();
    assert_eq!(found.len(), 1, "expected exactly one {kind} {name}, found {}", found.len());
    found[0]
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array().map(|a| a.iter().filter_map(|s| s.as_str().map(String::from)).collect()).unwrap_or_default()
}

/// The YAML that a commented-out block of `text` holds: the line `# KEY:` and the lines after it
/// that continue it at the same indentation (`# - ...`, `#   ...`), uncommented.
fn commented_block(text: &str, key: &str) -> Value {
    let mut lines = text.lines();
    let start = lines.find(|l| l.trim() == format!("# {key}:")).unwrap_or_else(|| panic!("no `# {key}:` line"));
    let indent = &start[..start.find('#').unwrap()];
    let prefix = format!("{indent}# ");
    let mut yaml = vec![format!("{key}:")];
    for l in lines {
        match l.strip_prefix(&prefix) {
            Some(rest) if rest.starts_with('-') || rest.starts_with(' ') => yaml.push(rest.to_string()),
            _ => break,
        }
    }
    let v = documents(&yaml.join("\n"), key).remove(0);
    v[key].clone()
}

/// The KubeSchedulerConfiguration in a ConfigMap's `kube-scheduler-config.yaml`.
fn embedded_config(cm: &Value) -> Value {
    let text = cm["data"]["kube-scheduler-config.yaml"].as_str().expect("data kube-scheduler-config.yaml");
    documents(text, "the ConfigMap's kube-scheduler-config.yaml").remove(0)
}

/// `gpuplace <args> --help` succeeds: the arguments parse with the binary's definitions.
fn assert_extender_args_parse(deployment: &Value) {
    let args = strings(&deployment["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert_eq!(args.first().map(String::as_str), Some("serve"), "{args:?}");
    let out = Command::new(env!("CARGO_BIN_EXE_gpuplace")).args(&args).arg("--help").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success() && !err.contains("error:"), "{args:?}: {err}");
}

#[test]
fn helm_lint_strict_is_clean() {
    let cases: Vec<(&str, Vec<String>)> = vec![
        ("default values", vec![]),
        ("own certificates", values(&["extender.tls.mode=secret"])),
        ("no TLS", values(&["extender.tls.mode=off"])),
        ("scheduler.mode=config", values(&["scheduler.mode=config"])),
        ("fake topology", fake_topology_values()),
        ("DRA", values(&["devicePlugin.dra.enabled=true", "devicePlugin.dra.driver=gpu.example.com"])),
        ("everything optional", every_option()),
    ];
    for (what, args) in cases {
        let mut all = vec!["lint".to_string(), "--strict".to_string(), chart().display().to_string()];
        all.extend(["--namespace", NAMESPACE, "--kube-version", "1.36.0"].iter().map(|s| s.to_string()));
        all.extend(args);
        let out = run_helm(&all);
        let noisy: Vec<&str> = out.lines().filter(|l| l.contains("[WARNING]") || l.contains("[ERROR]")).collect();
        assert!(noisy.is_empty(), "helm lint --strict ({what}):\n{out}");
        assert!(out.contains("0 chart(s) failed"), "helm lint --strict ({what}):\n{out}");
    }
}

/// Every YAML file of scheduler-config/ (outside the chart) is compared by some test here or is an
/// object the chart does not apply, so that a new plain file cannot be left out of the chart.
#[test]
fn every_plain_file_is_accounted_for() {
    let root = config_dir();
    let mut known: Vec<&str> = DEFAULT_FILES.iter().chain(MONITORING_FILES).chain(NOT_OBJECTS).copied().collect();
    known.extend([NAMESPACE_FILE, DRA_FILE, DRA_GPUPLACE_FILE]);
    for f in yaml_files(&root) {
        let rel = f.strip_prefix(&root).unwrap().display().to_string();
        assert!(known.contains(&rel.as_str()), "scheduler-config/{rel}: not in tests/helm_chart/main.rs's lists");
    }
    for k in &known {
        assert!(root.join(k).is_file(), "scheduler-config/{k} is gone: update tests/helm_chart/main.rs");
    }
}

#[test]
fn the_default_rendering_is_the_plain_manifests() {
    let rendered = by_key(render(&[]), "helm template");
    assert_same_objects("default values", &plain_objects(DEFAULT_FILES), &rendered);
    // nothing the default rendering applies needs a CRD; the only Namespace is the utilization one
    // (the release's comes from `helm install --create-namespace`)
    for k in rendered.keys() {
        let other_namespace = k.contains(" Namespace ") && !k.contains("gpuplace-utilization");
        assert!(!k.contains("monitoring.coreos.com") && !other_namespace, "{k} in the default rendering");
    }
    assert_extender_args_parse(find(&render(&[]), "Deployment", "gpuplace-extender"));
}

/// The records policy (on by default, in the default rendering) names the release namespace's
/// ServiceAccounts, and `recordsPolicy.enabled=false` leaves it out, and nothing else.
#[test]
fn the_records_policy_follows_the_namespace_and_can_be_left_out() {
    let policy = find(&render_in("gpu-ops", &[]), "ValidatingAdmissionPolicy", "gpuplace-records").to_string();
    for account in ["gpuplace-extender", "gpuplace-device-plugin"] {
        assert!(policy.contains(&format!("'system:serviceaccount:gpu-ops:{account}'")), "{policy}");
    }
    assert!(!policy.contains("gpuplace-system"), "{policy}");
    let without = by_key(render(&values(&["recordsPolicy.enabled=false"])), "helm template");
    let mut default = by_key(render(&[]), "helm template");
    let all = default.len();
    default.retain(|k, _| !k.ends_with("/gpuplace-records"));
    assert_eq!(default.len() + 2, all, "the policy and its binding");
    assert_same_objects("recordsPolicy.enabled=false", &default, &without);
}

/// DRA mode: the DeviceClass and the resourceslices RBAC of `device-plugin/dra.yaml` beside the
/// default objects, and the DaemonSet's plugin runs with `--dra` instead of `--no-assignments`'s
/// place; another driver name renames the DeviceClass, its selector and the flag.
#[test]
fn dra_mode_adds_the_dra_manifest() {
    let plain_ds = plain_documents("device-plugin/daemonset.yaml");
    let plain_args = strings(&plain_ds[0]["spec"]["template"]["spec"]["containers"][0]["args"]);
    let docs = render(&values(&["devicePlugin.dra.enabled=true"]));
    let ds = find(&docs, "DaemonSet", "gpuplace-device-plugin").clone();
    let args = strings(&ds["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert_eq!(args, [&plain_args[..1], &["--dra".to_string()], &plain_args[1..]].concat(), "the plugin's arguments");
    // kubelet's registration and DRA plugin folders and the CDI folder, from the host
    let names = |v: &Value| -> Vec<String> {
        v.as_array().unwrap().iter().map(|m| m["name"].as_str().unwrap().to_string()).collect()
    };
    let pod = &ds["spec"]["template"]["spec"];
    let plain_pod = &plain_ds[0]["spec"]["template"]["spec"];
    let dra_volumes = ["plugins-registry", "dra-plugins", "cdi"].map(String::from);
    assert_eq!(names(&pod["volumes"]), [names(&plain_pod["volumes"]), dra_volumes.to_vec()].concat());
    assert_eq!(
        names(&pod["containers"][0]["volumeMounts"]),
        [names(&plain_pod["containers"][0]["volumeMounts"]), dra_volumes.to_vec()].concat()
    );
    let mounts = pod["containers"][0]["volumeMounts"].as_array().unwrap();
    let at = |name: &str| mounts.iter().find(|m| m["name"] == name).unwrap()["mountPath"].as_str().unwrap().to_string();
    assert_eq!((at("dra-plugins"), at("cdi")), ("/var/lib/kubelet/plugins".to_string(), "/var/run/cdi".to_string()));
    // everything else is exactly the plain files
    let strip = |mut m: BTreeMap<String, Value>| {
        m.retain(|k, _| !k.contains(" DaemonSet "));
        m
    };
    let files: Vec<&str> = DEFAULT_FILES.iter().copied().chain([DRA_FILE]).collect();
    assert_same_objects(
        "devicePlugin.dra.enabled",
        &strip(plain_objects(&files)),
        &strip(by_key(docs, "helm template")),
    );

    let docs = render(&values(&[
        "devicePlugin.dra.enabled=true",
        "devicePlugin.dra.driver=gpu.example.com",
        "devicePlugin.kubeletRootDir=/var/snap/k8s/kubelet",
    ]));
    let class = find(&docs, "DeviceClass", "gpu.example.com");
    assert_eq!(class["spec"]["selectors"][0]["cel"]["expression"], "device.driver == \"gpu.example.com\"");
    let ds = find(&docs, "DaemonSet", "gpuplace-device-plugin");
    let args = strings(&ds["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert!(
        args.contains(&"--dra".to_string()) && args.contains(&"--dra-driver=gpu.example.com".to_string()),
        "{args:?}"
    );
    // the plugin itself refuses --dra with --no-assignments: the chart never renders both
    let docs = render(&values(&["devicePlugin.dra.enabled=true", "devicePlugin.noAssignments=true"]));
    let ds = find(&docs, "DaemonSet", "gpuplace-device-plugin");
    assert!(
        !strings(&ds["spec"]["template"]["spec"]["containers"][0]["args"]).contains(&"--no-assignments".to_string())
    );
}

/// gpuplace allocating the claims: the gate policy and the extender's DRA RBAC of
/// `dra/gpuplace-allocates.yaml` beside DRA mode's objects, the plugins taint their devices and the
/// extender runs its DRA front end (flags its parser takes).
#[test]
fn gpuplace_as_the_dra_allocator_adds_the_gate_policy_and_its_rbac() {
    let docs = render(&values(&["devicePlugin.dra.enabled=true", "devicePlugin.dra.allocator=gpuplace"]));
    let ds = find(&docs, "DaemonSet", "gpuplace-device-plugin");
    let args = strings(&ds["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert!(args.contains(&"--dra-allocator=gpuplace".to_string()), "{args:?}");
    let deployment = find(&docs, "Deployment", "gpuplace-extender");
    let args = strings(&deployment["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert!(args.contains(&"--dra-driver=gpu.gpuplace.io".to_string()), "{args:?}");
    assert_extender_args_parse(deployment);
    let strip = |mut m: BTreeMap<String, Value>| {
        m.retain(|k, _| !k.contains(" DaemonSet ") && !k.contains(" Deployment "));
        m
    };
    let files: Vec<&str> = DEFAULT_FILES.iter().copied().chain([DRA_FILE, DRA_GPUPLACE_FILE]).collect();
    assert_same_objects(
        "devicePlugin.dra.allocator=gpuplace",
        &strip(plain_objects(&files)),
        &strip(by_key(docs.clone(), "helm template")),
    );
    // kube-scheduler allocating (the default): neither the policy nor the flags
    let docs = render(&values(&["devicePlugin.dra.enabled=true"]));
    assert!(!by_key(docs.clone(), "helm template").keys().any(|k| k.contains("gpuplace-dra-gate")));
    let deployment = find(&docs, "Deployment", "gpuplace-extender");
    let args = strings(&deployment["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert!(!args.iter().any(|a| a.starts_with("--dra")), "{args:?}");
}

#[test]
fn monitoring_and_the_namespace_are_the_plain_manifests() {
    let rendered = by_key(render(&values(&["monitoring.enabled=true", "namespace.create=true"])), "helm template");
    let files: Vec<&str> = DEFAULT_FILES.iter().chain(MONITORING_FILES).copied().chain([NAMESPACE_FILE]).collect();
    assert_same_objects("monitoring.enabled, namespace.create", &plain_objects(&files), &rendered);
}

#[test]
fn the_grafana_dashboard_configmap_holds_the_dashboard() {
    let plain = fs::read(config_dir().join("monitoring/grafana-dashboard.json")).unwrap();
    let copy = fs::read(chart().join("files/grafana-dashboard.json")).unwrap();
    assert!(
        plain == copy,
        "scheduler-config/helm/gpuplace/files/grafana-dashboard.json is not a copy of \
         scheduler-config/monitoring/grafana-dashboard.json: cp the latter over the former"
    );
    let docs = render(&values(&["monitoring.grafanaDashboard.enabled=true"]));
    let cm = find(&docs, "ConfigMap", "gpuplace-grafana-dashboard");
    assert_eq!(cm["metadata"]["namespace"], NAMESPACE);
    assert_eq!(cm["metadata"]["labels"]["grafana_dashboard"], "1", "the label Grafana's sidecar looks for");
    let data = cm["data"].as_object().expect("data");
    assert_eq!(data.len(), 1, "one dashboard");
    let text = data.values().next().unwrap().as_str().expect("text");
    let want: Value = serde_json::from_slice(&plain).unwrap();
    assert_eq!(serde_json::from_str::<Value>(text).expect("the dashboard's JSON"), want);
    // the dashboard alone: the rest is the default rendering
    let rest: Vec<Value> = docs.into_iter().filter(|d| d["metadata"]["name"] != "gpuplace-grafana-dashboard").collect();
    assert_same_objects("grafanaDashboard.enabled", &plain_objects(DEFAULT_FILES), &by_key(rest, "helm template"));
}

/// The default install's kube-scheduler (option A) finds its client certificate and the extender's CA
/// where the reference configuration's `tlsConfig` says: the Secret the extender writes, projected
/// under the configuration's directory.
#[test]
fn option_a_mounts_the_client_certificate_where_tls_config_reads_it() {
    let docs = render(&[]);
    let reference = plain_documents("kube-scheduler-config.yaml").remove(0);
    let config = embedded_config(find(&docs, "ConfigMap", "gpuplace-scheduler-config"));
    assert_eq!(config["extenders"], reference["extenders"]);
    assert_eq!(config["extenders"][0]["enableHTTPS"], true);
    let sched = find(&docs, "Deployment", "gpuplace-scheduler");
    let mount = &sched["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0];
    let dir = mount["mountPath"].as_str().expect("mountPath").to_string() + "/";
    let volume = &sched["spec"]["template"]["spec"]["volumes"][0];
    assert_eq!(volume["name"], mount["name"]);
    let mut paths: Vec<String> = vec![];
    for source in volume["projected"]["sources"].as_array().expect("a projected volume") {
        if let Some(name) = source["configMap"]["name"].as_str() {
            assert_eq!(name, "gpuplace-scheduler-config");
            paths.push("kube-scheduler-config.yaml".into());
        }
        for item in source["secret"]["items"].as_array().into_iter().flatten() {
            assert_eq!(source["secret"]["name"], gpuplace::k8s::certificates::DEFAULT_SCHEDULER_SECRET_NAME);
            let key = item["key"].as_str().unwrap();
            assert!(
                [
                    gpuplace::k8s::certificates::CA_CERT,
                    gpuplace::k8s::certificates::SCHEDULER_CERT,
                    gpuplace::k8s::certificates::SCHEDULER_KEY
                ]
                .contains(&key),
                "{key}: an entry the extender writes"
            );
            paths.push(item["path"].as_str().unwrap().into());
        }
    }
    for f in ["caFile", "certFile", "keyFile"] {
        let file = config["extenders"][0]["tlsConfig"][f].as_str().expect(f);
        let rel = file.strip_prefix(&dir).unwrap_or_else(|| panic!("{f} {file} is not under {dir}"));
        assert!(paths.contains(&rel.to_string()), "{f} {file}: not in the mounted volume ({paths:?})");
    }
}

/// Arguments of a rendered extender Deployment.
fn extender_args(docs: &[Value]) -> Vec<String> {
    strings(&find(docs, "Deployment", "gpuplace-extender")["spec"]["template"]["spec"]["containers"][0]["args"])
}

#[test]
fn own_certificates_replace_the_ca_secret_with_the_commented_files() {
    let text = fs::read_to_string(config_dir().join("extender/deployment.yaml")).unwrap();
    let plain = plain_documents("extender/deployment.yaml").remove(0);
    let docs = render(&values(&["extender.tls.mode=secret"]));
    let dep = find(&docs, "Deployment", "gpuplace-extender");
    let (pod, c) = (&dep["spec"]["template"]["spec"], &dep["spec"]["template"]["spec"]["containers"][0]);
    let plain_c = &plain["spec"]["template"]["spec"]["containers"][0];

    // the arguments: the plain ones without --tls-ca-secret, then exactly the commented-out TLS ones
    let commented: Vec<String> = text
        .lines()
        .filter_map(|l| l.trim().strip_prefix("# - --"))
        .filter(|a| a.starts_with("tls-") || a.starts_with("forward-server-name"))
        .map(|a| format!("--{a}"))
        .collect();
    assert_eq!(commented.len(), 4, "the plain Deployment's commented TLS arguments: {commented:?}");
    let mut want = strings(&plain_c["args"]);
    let before = want.len();
    want.retain(|a| !a.starts_with("--tls-ca-secret="));
    assert_eq!(want.len(), before - 1, "the plain Deployment has --tls-ca-secret");
    want.extend(commented);
    assert_eq!(strings(&c["args"]), want);
    assert_extender_args_parse(dep);

    // the volume and its mount, as commented out; the probes as they are (the probe port)
    assert_eq!(c["volumeMounts"], commented_block(&text, "volumeMounts"));
    assert_eq!(pod["volumes"], commented_block(&text, "volumes"));
    for probe in ["readinessProbe", "livenessProbe"] {
        assert_eq!(c[probe], plain_c[probe], "{probe}");
    }
    // kube-scheduler's side is the default's: HTTPS, the same Secret mounted; the extender makes no
    // certificate, so it gets no Role for the Secrets
    let default = render(&[]);
    for name in ["gpuplace-scheduler-config", "gpuplace-scheduler"] {
        let kind = if name == "gpuplace-scheduler" { "Deployment" } else { "ConfigMap" };
        assert_eq!(find(&docs, kind, name), find(&default, kind, name), "{kind} {name}");
    }
    assert!(docs.iter().all(|d| d["metadata"]["name"] != "gpuplace-extender-certificates"));
}

#[test]
fn tls_off_is_plain_http_everywhere() {
    let docs = render(&values(&["extender.tls.mode=off"]));
    let args = extender_args(&docs);
    assert!(args.iter().all(|a| !a.starts_with("--tls")), "{args:?}");
    let mut want = extender_args(&render(&[]));
    want.retain(|a| !a.starts_with("--tls-ca-secret="));
    assert_eq!(args, want);
    assert!(docs.iter().all(|d| d["metadata"]["name"] != "gpuplace-extender-certificates"));
    let reference = plain_documents("kube-scheduler-config-http.yaml").remove(0);
    let config = embedded_config(find(&docs, "ConfigMap", "gpuplace-scheduler-config"));
    assert_eq!(config["extenders"], reference["extenders"]);
    let sched = find(&docs, "Deployment", "gpuplace-scheduler");
    assert_eq!(sched["spec"]["template"]["spec"]["volumes"][0]["configMap"]["name"], "gpuplace-scheduler-config");
    let docs = render(&values(&["extender.tls.mode=off", "scheduler.mode=config"]));
    assert_eq!(embedded_config(find(&docs, "ConfigMap", "gpuplace-kube-scheduler-config")), reference);
    // the admission policy lets the extender write its key Secret only
    let vap = find(&docs, "ValidatingAdmissionPolicy", "gpuplace-extender-scope").to_string();
    assert!(!vap.contains("gpuplace-extender-ca"), "{vap}");
}

#[test]
fn a_values_file_from_before_tls_modes_is_refused_with_what_to_set() {
    let mut args = vec!["template".to_string(), "gpuplace".into(), chart().display().to_string()];
    args.extend(values(&["extender.tls.enabled=true"]));
    let out = Command::new(helm()).args(&args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "rendered");
    assert!(err.contains("extender.tls.mode"), "{err}");
}

/// kubelet dials a DRA driver's sockets by their host paths: a root folder that makes them longer
/// than a Unix socket path holds is refused at render time, not found as a driver that never
/// registers.
#[test]
fn a_dra_socket_path_too_long_for_kubelet_is_refused() {
    let root = format!("/var/lib/{}", "k".repeat(60));
    let mut args = vec!["template".to_string(), "gpuplace".into(), chart().display().to_string()];
    args.extend(values(&["devicePlugin.dra.enabled=true", &format!("devicePlugin.kubeletRootDir={root}")]));
    let out = Command::new(helm()).args(&args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "rendered");
    assert!(err.contains("plugins_registry/gpu.gpuplace.io-reg.sock 111 bytes long"), "{err}");
    // the same folder without DRA renders (the device-plugin socket's path is fixed)
    render(&values(&[&format!("devicePlugin.kubeletRootDir={root}")]));
}

#[test]
fn the_config_mode_is_the_reference_file() {
    let reference = plain_documents("kube-scheduler-config.yaml").remove(0);
    let docs = render(&values(&["scheduler.mode=config"]));
    let cm = find(&docs, "ConfigMap", "gpuplace-kube-scheduler-config");
    assert_eq!(cm["metadata"]["namespace"], NAMESPACE);
    assert_eq!(embedded_config(cm), reference);
    // no second scheduler; everything else is the default rendering
    let second: BTreeMap<String, Value> = plain_objects(&["second-profile/gpuplace-scheduler.yaml"]);
    let mut want = plain_objects(DEFAULT_FILES);
    want.retain(|k, _| !second.contains_key(k));
    let rest: Vec<Value> = docs.iter().filter(|d| *d != cm).cloned().collect();
    assert_same_objects("scheduler.mode=config", &want, &by_key(rest, "helm template"));

    // the URL follows the Service into another namespace, and scheduler.extenderURL overrides it
    let docs = render_in("gpu-sched", &values(&["scheduler.mode=config"]));
    let config = embedded_config(find(&docs, "ConfigMap", "gpuplace-kube-scheduler-config"));
    assert_eq!(config["extenders"][0]["urlPrefix"], "https://gpuplace-extender.gpu-sched.svc:8888/gpuplace");
    assert_eq!(config["extenders"][0]["tlsConfig"]["serverName"], "gpuplace-extender.gpu-sched.svc");
    let mut substituted = config.clone();
    substituted["extenders"][0]["urlPrefix"] = reference["extenders"][0]["urlPrefix"].clone();
    substituted["extenders"][0]["tlsConfig"]["serverName"] =
        reference["extenders"][0]["tlsConfig"]["serverName"].clone();
    assert_eq!(substituted, reference, "only the URL and the name verified change with the namespace");
    let url = "https://10.96.0.42:8888/gpuplace";
    let docs = render(&values(&["scheduler.mode=config", &format!("scheduler.extenderURL={url}")]));
    let config = embedded_config(find(&docs, "ConfigMap", "gpuplace-kube-scheduler-config"));
    assert_eq!(config["extenders"][0]["urlPrefix"], url);

    // none: no scheduler object at all
    let docs = render(&values(&["scheduler.mode=none"]));
    let mut want = plain_objects(DEFAULT_FILES);
    want.retain(|k, _| !second.contains_key(k));
    assert_same_objects("scheduler.mode=none", &want, &by_key(docs, "helm template"));
}

#[test]
fn a_fake_topology_is_mounted_and_passed_without_nvidia() {
    let topology = fs::read_to_string(topology_file()).unwrap();
    let docs = render(&fake_topology_values());
    let cm = find(&docs, "ConfigMap", "gpuplace-device-plugin-topology");
    assert_eq!(cm["metadata"]["namespace"], NAMESPACE);
    let text = cm["data"]["topology.json"].as_str().expect("data topology.json");
    assert_eq!(text.trim_end(), topology.trim_end(), "the topology, as given");
    assert_eq!(serde_json::from_str::<Value>(text).unwrap(), serde_json::from_str::<Value>(&topology).unwrap());

    let ds = find(&docs, "DaemonSet", "gpuplace-device-plugin");
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    let args = strings(&c["args"]);
    assert_eq!(args, ["serve", "--fake-topology=/etc/gpuplace/topology/topology.json"]);
    let mount = c["volumeMounts"].as_array().unwrap().iter().find(|m| m["mountPath"] == "/etc/gpuplace/topology");
    let mount = mount.expect("the topology's mount");
    assert_eq!(mount["readOnly"], true);
    let volume = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == mount["name"]).expect("its volume");
    assert_eq!(volume["configMap"]["name"], "gpuplace-device-plugin-topology");
    let env: Vec<&str> = c["env"].as_array().unwrap().iter().filter_map(|e| e["name"].as_str()).collect();
    assert!(env.iter().all(|e| !e.starts_with("NVIDIA_")), "{env:?}");

    // the rest is the plain DaemonSet: take the plain one, make the same four changes, compare
    let mut want = plain_documents("device-plugin/daemonset.yaml").remove(0);
    let wc = &mut want["spec"]["template"]["spec"]["containers"][0];
    wc["args"] = json!(args);
    wc["env"].as_array_mut().unwrap().retain(|e| !e["name"].as_str().unwrap().starts_with("NVIDIA_"));
    wc["volumeMounts"].as_array_mut().unwrap().push(mount.clone());
    want["spec"]["template"]["spec"]["volumes"].as_array_mut().unwrap().push(volume.clone());
    let annotations = &ds["spec"]["template"]["metadata"]["annotations"];
    assert!(annotations["checksum/topology"].is_string(), "a changed topology rolls the DaemonSet");
    want["spec"]["template"]["metadata"]["annotations"] = annotations.clone();
    let mut d = Vec::new();
    differences("", &want, ds, &mut d);
    assert!(
        d.is_empty(),
        "the fake-topology DaemonSet differs from the plain one beyond the topology:\n{}",
        d.join("\n")
    );
}

/// Every optional value set at once: lint is clean, every extender argument parses with the binary,
/// and the namespaces that follow values do.
fn every_option() -> Vec<String> {
    let mut v = values(&[
        "namespace.create=true",
        "imagePullSecrets[0].name=regcred",
        "utilizationNamespace=gpu-util",
        "extender.image.repository=registry.example.com/gpuplace",
        "extender.image.tag=v0.1.0",
        "extender.logFormat=json",
        "extender.placementLogEveryCall=true",
        "extender.nodesToScore=0",
        "extender.nodesToScoreSoft=8",
        "extender.groupTimeoutSeconds=600",
        "extender.watchNodeSelector=nvidia.com/gpu.present=true",
        "extender.forwardTimeoutMs=3000",
        "extender.acceptUnsignedAssignments=true",
        "extender.assignmentKeySecret.namespace=gpuplace-keys",
        "extender.assignmentKeySecret.name=keys",
        "extender.policy.mixHalfLife=2000",
        "extender.policy.mixState.enabled=true",
        "extender.extraArgs[0]=--workers=4",
        "extender.tls.mode=secret",
        "scheduler.tls.secretName=sched-tls",
        "extender.networkPolicy.ipBlocks[0]=192.0.2.10/32",
        "devicePlugin.logFormat=json",
        "devicePlugin.noAssignments=true",
        "devicePlugin.slotsPerGpu=20",
        "devicePlugin.runtimeClassName=nvidia",
        "devicePlugin.mps.enabled=true",
        "devicePlugin.mps.root=/var/run/gpuplace-mps",
        "scheduler.verbosity=4",
        "monitoring.enabled=true",
        "monitoring.additionalLabels.release=kps",
        "monitoring.grafanaDashboard.enabled=true",
    ]);
    v.extend(fake_topology_values());
    v
}

#[test]
fn every_option_renders_and_the_extender_arguments_parse() {
    let docs = render(&every_option());
    let dep = find(&docs, "Deployment", "gpuplace-extender");
    assert_extender_args_parse(dep);
    let args = strings(&dep["spec"]["template"]["spec"]["containers"][0]["args"]);
    for a in [
        "--utilization-namespace=gpu-util",
        "--assignment-key-secret=gpuplace-keys/keys",
        "--nodes-to-score=0",
        "--mix-state=/var/lib/gpuplace/mix-state.json",
        "--workers=4",
    ] {
        assert!(args.iter().any(|x| x == a), "{a} not in {args:?}");
    }
    // the Roles follow the namespaces and the Secret's name the binaries are given
    assert_eq!(find(&docs, "Role", "gpuplace-extender-utilization")["metadata"]["namespace"], "gpu-util");
    assert_eq!(find(&docs, "Role", "gpuplace-device-plugin-utilization")["metadata"]["namespace"], "gpu-util");
    assert_eq!(
        find(&docs, "Namespace", "gpu-util")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"],
        "restricted"
    );
    assert_eq!(find(&docs, "Role", "gpuplace-device-plugin-public-keys")["metadata"]["namespace"], "gpuplace-keys");
    // the admission policy follows the key Secret's namespace and name
    let policy = find(&docs, "ValidatingAdmissionPolicy", "gpuplace-extender-scope").to_string();
    assert!(policy.contains("request.namespace == 'gpuplace-keys' && variables.name == 'keys'"), "{policy}");
    let keys = find(&docs, "Role", "gpuplace-extender-assignment-keys");
    assert_eq!(keys["metadata"]["namespace"], "gpuplace-keys");
    assert!(keys["rules"].as_array().unwrap().iter().any(|r| strings(&r["resourceNames"]) == ["keys"]), "{keys}");
    let ds = find(&docs, "DaemonSet", "gpuplace-device-plugin");
    let dargs = strings(&ds["spec"]["template"]["spec"]["containers"][0]["args"]);
    assert!(dargs.contains(&"--utilization-namespace=gpu-util".to_string()), "{dargs:?}");
    let public = "--assignment-public-keys=gpuplace-keys/gpuplace-assignment-public-keys".to_string();
    assert!(dargs.contains(&public), "{dargs:?}");
    assert!(dargs.contains(&"--no-assignments".to_string()) && dargs.contains(&"--slots-per-gpu=20".to_string()));
    for kind in ["ServiceMonitor", "PodMonitor", "PrometheusRule"] {
        let o = docs.iter().find(|d| d["kind"] == kind).unwrap_or_else(|| panic!("{kind}"));
        assert_eq!(o["metadata"]["labels"]["release"], "kps", "{kind}: monitoring.additionalLabels");
    }
}

/// Issue 48: scrapers are admitted by the namespaces the operator names, matched on the label the
/// API server sets (`kubernetes.io/metadata.name`), never on a label a tenant can set; per-pod
/// series only when asked for. By default neither port admits a scraper and no series names a pod
/// (`the_default_rendering_is_the_plain_manifests`, tests/scheduler_config.rs).
#[test]
fn scrapers_are_named_by_namespace_and_pod_series_are_asked_for() {
    let set = |v: &str| ["--set".to_string(), v.to_string()];
    let args: Vec<String> = [
        "extender.networkPolicy.scrapeNamespaces={monitoring,obs}",
        "devicePlugin.networkPolicy.scrapeNamespaces={monitoring}",
        "extender.metricsPodSeries=true",
        "devicePlugin.metricsPodSeries=true",
    ]
    .iter()
    .flat_map(|v| set(v))
    .collect();
    let docs = render(&args);
    for (name, port, namespaces) in
        [("gpuplace-extender", 9090, vec!["monitoring", "obs"]), ("gpuplace-device-plugin", 9400, vec!["monitoring"])]
    {
        let np = find(&docs, "NetworkPolicy", name);
        let ingress = np["spec"]["ingress"].as_array().expect("ingress");
        let rule = ingress.iter().find(|r| r["ports"][0]["port"] == port).unwrap_or_else(|| panic!("{name}: {np}"));
        assert_eq!(
            rule["from"],
            json!([{"namespaceSelector": {"matchExpressions": [
                {"key": "kubernetes.io/metadata.name", "operator": "In", "values": namespaces}
            ]}}]),
            "{name}"
        );
        // no peer anywhere selects every namespace
        for r in ingress {
            for peer in r["from"].as_array().expect("from") {
                assert_ne!(peer["namespaceSelector"], json!({}), "{name}: {peer}");
            }
        }
    }
    let dep = find(&docs, "Deployment", "gpuplace-extender");
    assert_extender_args_parse(dep);
    assert!(strings(&dep["spec"]["template"]["spec"]["containers"][0]["args"]).contains(&"--metrics-pod-series".into()));
    let ds = find(&docs, "DaemonSet", "gpuplace-device-plugin");
    assert!(strings(&ds["spec"]["template"]["spec"]["containers"][0]["args"]).contains(&"--metrics-pod-series".into()));
    // a value that is no namespace name is refused
    let mut all: Vec<String> = ["template", "gpuplace"].iter().map(|s| s.to_string()).collect();
    all.push(chart().display().to_string());
    all.extend(set("extender.networkPolicy.scrapeNamespaces={Not_A_Namespace}"));
    let out = Command::new(helm()).args(&all).output().expect("helm");
    assert!(!out.status.success(), "helm accepted a namespace name with capitals");
}
