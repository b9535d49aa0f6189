//! The manifests under scheduler-config/ agree with the code: resource names, the extender's port,
//! prefix, verbs and probe routes. Parses every YAML document there (multi-document files split on
//! `---`), and starts one static-mode server to check that the probe paths are real routes.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use gpuplace::extender::http::{spawn, HttpOptions, DEFAULT_LISTEN, DEFAULT_PREFIX};
use gpuplace::extender::http_client::Connection;
use gpuplace::k8s::keys::{KeySecret, DEFAULT_KEY_SECRET_NAME, DEFAULT_PUBLIC_KEYS_NAME};
use gpuplace_core::inventory::load_cluster;
use gpuplace_core::resources::{RESOURCE_GPU, RESOURCE_GPU_CORE, RESOURCE_GPU_MEM};
use gpuplace_core::utilization_configmap::DEFAULT_UTILIZATION_NAMESPACE;
use gpuplace_core::DEFAULT_NAMESPACE;
use serde_norway::Value;
use yaml_files::yaml_files;

#[path = "support/harness.rs"]
mod harness;
#[path = "support/yaml_files.rs"]
mod yaml_files;

const NAMESPACE: &str = "gpuplace-system";
const SERVICE: &str = "gpuplace-extender";

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Every non-empty document of every YAML file under scheduler-config/, with where it came from.
fn documents() -> Vec<(String, Value)> {
    let files = yaml_files(&root().join("scheduler-config"));
    assert!(!files.is_empty(), "no YAML under scheduler-config/");
    let mut docs = Vec::new();
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let name = f.strip_prefix(root()).unwrap().display().to_string();
        for (i, part) in text.split("\n---").enumerate() {
            let v: Value = serde_norway::from_str(part).unwrap_or_else(|e| panic!("{name} document {i}: {e}"));
            if v.is_null() {
                continue; // comments only
            }
            assert!(v["apiVersion"].is_string() && v["kind"].is_string(), "{name} document {i}: no apiVersion/kind");
            docs.push((format!("{name}#{i}"), v));
        }
    }
    docs
}

fn kind<'a>(docs: &'a [(String, Value)], kind: &str) -> Vec<&'a (String, Value)> {
    docs.iter().filter(|(_, v)| v["kind"].as_str() == Some(kind)).collect()
}

fn named<'a>(docs: &'a [(String, Value)], k: &str, name: &str) -> &'a Value {
    let found: Vec<_> =
        kind(docs, k).into_iter().filter(|(_, v)| v["metadata"]["name"].as_str() == Some(name)).collect();
    assert_eq!(found.len(), 1, "expected exactly one {k} {name}");
    &found[0].1
}

fn serve_port() -> u64 {
    DEFAULT_LISTEN.rsplit(':').next().unwrap().parse().unwrap()
}

/// KubeSchedulerConfigurations: top-level documents and those embedded in ConfigMaps.
fn scheduler_configs(docs: &[(String, Value)]) -> Vec<(String, Value)> {
    let mut out: Vec<(String, Value)> =
        kind(docs, "KubeSchedulerConfiguration").into_iter().map(|(n, v)| (n.clone(), v.clone())).collect();
    for (name, cm) in kind(docs, "ConfigMap") {
        if let Some(data) = cm["data"].as_mapping() {
            for (key, text) in data {
                let v: Value = serde_norway::from_str(text.as_str().unwrap())
                    .unwrap_or_else(|e| panic!("{name} data {key:?}: {e}"));
                if v["kind"].as_str() == Some("KubeSchedulerConfiguration") {
                    out.push((format!("{name} data {key:?}"), v));
                }
            }
        }
    }
    out
}

#[test]
fn scheduler_configs_match_the_extender() {
    let docs = documents();
    let configs = scheduler_configs(&docs);
    assert!(configs.len() >= 2, "expected the reference config and the second profile's, got {}", configs.len());
    let want_url = format!("http://{SERVICE}.{NAMESPACE}.svc:{}{DEFAULT_PREFIX}", serve_port());
    let want_https = format!("https://{SERVICE}.{NAMESPACE}.svc:{}{DEFAULT_PREFIX}", serve_port());
    let mut scheduler_names = Vec::new();
    let (mut with_tls, mut plain_http) = (Vec::new(), Vec::new());
    for (name, c) in &configs {
        assert_eq!(c["apiVersion"].as_str(), Some("kubescheduler.config.k8s.io/v1"), "{name}");
        assert_eq!(c["percentageOfNodesToScore"].as_u64(), Some(100), "{name}");
        let extenders = c["extenders"].as_sequence().unwrap_or_else(|| panic!("{name}: no extenders"));
        assert_eq!(extenders.len(), 1, "{name}");
        let e = &extenders[0];
        if e["enableHTTPS"].as_bool() == Some(true) {
            // serve --tls-cert/--tls-key/--tls-client-ca: kube-scheduler verifies the extender
            // against caFile (the Service's name, also when urlPrefix is a ClusterIP) and presents
            // its client certificate
            with_tls.push(name.to_string());
            assert_eq!(e["urlPrefix"].as_str(), Some(want_https.as_str()), "{name}");
            let tls = &e["tlsConfig"];
            for f in ["caFile", "certFile", "keyFile"] {
                assert!(tls[f].as_str().is_some_and(|p| p.starts_with('/')), "{name}: tlsConfig.{f}");
            }
            assert_eq!(tls["serverName"].as_str(), Some(&*format!("{SERVICE}.{NAMESPACE}.svc")), "{name}");
            assert_ne!(tls["insecure"].as_bool(), Some(true), "{name}: the extender must be verified");
        } else {
            plain_http.push(name.to_string());
            assert_eq!(e["urlPrefix"].as_str(), Some(want_url.as_str()), "{name}");
            assert_eq!(e["enableHTTPS"].as_bool(), Some(false), "{name}");
            assert!(e["tlsConfig"].is_null(), "{name}");
        }
        for (field, verb) in [
            ("filterVerb", "filter"),
            ("prioritizeVerb", "prioritize"),
            ("bindVerb", "bind"),
            ("preemptVerb", "preempt"),
        ] {
            assert_eq!(e[field].as_str(), Some(verb), "{name}: {field}");
        }
        assert_eq!(e["nodeCacheCapable"].as_bool(), Some(true), "{name}");
        assert_eq!(e["ignorable"].as_bool(), Some(false), "{name}");
        assert!(e["weight"].as_u64().is_some_and(|w| w > 0), "{name}: weight");
        assert!(e["httpTimeout"].is_string(), "{name}: httpTimeout");
        let managed: BTreeMap<&str, bool> = e["managedResources"]
            .as_sequence()
            .unwrap_or_else(|| panic!("{name}: no managedResources"))
            .iter()
            .map(|r| (r["name"].as_str().unwrap(), r["ignoredByScheduler"].as_bool().unwrap()))
            .collect();
        // gpu counted by kube-scheduler (device plugin slots); gpu-mem and gpu-core only by the
        // extender (kube-scheduler-config.yaml explains why)
        let want: BTreeMap<&str, bool> =
            [(RESOURCE_GPU, false), (RESOURCE_GPU_MEM, true), (RESOURCE_GPU_CORE, true)].into_iter().collect();
        assert_eq!(managed, want, "{name}: managedResources");
        for p in c["profiles"].as_sequence().unwrap_or_else(|| panic!("{name}: no profiles")) {
            scheduler_names.push(p["schedulerName"].as_str().unwrap().to_string());
        }
    }
    scheduler_names.sort();
    scheduler_names.dedup();
    assert_eq!(scheduler_names, ["default-scheduler", "gpuplace-scheduler"]);
    // secure by default: every configuration but the one for an extender without TLS
    assert_eq!(plain_http.len(), 1, "only kube-scheduler-config-http.yaml is plain HTTP: {plain_http:?}");
    assert!(plain_http[0].contains("kube-scheduler-config-http.yaml"), "{plain_http:?}");
    assert_eq!(with_tls.len(), configs.len() - 1, "{with_tls:?}");
}

/// The plain-HTTP variant (an extender without TLS) is the reference config (HTTPS) with only the
/// extender's urlPrefix, enableHTTPS and tlsConfig changed.
#[test]
fn the_plain_http_scheduler_config_is_the_reference_without_tls() {
    let read = |f: &str| -> Value {
        let text = std::fs::read_to_string(root().join("scheduler-config").join(f)).unwrap();
        serde_norway::from_str(&text).unwrap()
    };
    let strip = |mut v: Value| -> Value {
        for e in v["extenders"].as_sequence_mut().unwrap() {
            let e = e.as_mapping_mut().unwrap();
            for k in ["urlPrefix", "enableHTTPS", "tlsConfig"] {
                e.remove(k);
            }
        }
        v
    };
    let (tls, plain) = (read("kube-scheduler-config.yaml"), read("kube-scheduler-config-http.yaml"));
    assert_eq!(tls["extenders"][0]["enableHTTPS"].as_bool(), Some(true));
    assert_eq!(plain["extenders"][0]["enableHTTPS"].as_bool(), Some(false));
    assert_eq!(strip(plain), strip(tls));
}

/// Rollouts finish and voluntary disruptions leave one replica: the Deployment surges one pod and
/// keeps every replica available (both replicas are Ready, the standby forwards), the
/// PodDisruptionBudget and the anti-affinity select its pods, and the NetworkPolicy admits the
/// schedulers and the other replica to the verbs' port only, and no pod to the metrics and probe
/// ports until the operator names the scrapers' namespaces (issue 48: no label a tenant can set).
#[test]
fn rollout_disruption_budget_and_network_policy_fit_the_deployment() {
    let docs = documents();
    let dep = named(&docs, "Deployment", SERVICE);
    let pod = &dep["spec"]["template"];
    let labels = pod["metadata"]["labels"].as_mapping().unwrap();
    let selects = |sel: &Value| {
        let m = sel["matchLabels"].as_mapping().unwrap_or_else(|| panic!("no matchLabels: {sel:?}"));
        !m.is_empty() && m.iter().all(|(k, v)| labels.get(k) == Some(v))
    };
    assert_eq!(dep["spec"]["replicas"].as_u64(), Some(2));
    assert_eq!(dep["spec"]["strategy"]["type"].as_str(), Some("RollingUpdate"));
    let ru = &dep["spec"]["strategy"]["rollingUpdate"];
    assert_eq!((ru["maxSurge"].as_u64(), ru["maxUnavailable"].as_u64()), (Some(1), Some(0)));
    let c = &pod["spec"]["containers"][0];
    let env = c["env"].as_sequence().unwrap();
    let pod_ip =
        env.iter().find(|e| e["name"].as_str() == Some("POD_IP")).expect("POD_IP: the default --advertise-url");
    assert_eq!(pod_ip["valueFrom"]["fieldRef"]["fieldPath"].as_str(), Some("status.podIP"));
    let anti = &pod["spec"]["affinity"]["podAntiAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0];
    assert_eq!(anti["podAffinityTerm"]["topologyKey"].as_str(), Some("kubernetes.io/hostname"));
    assert!(selects(&anti["podAffinityTerm"]["labelSelector"]));

    let pdb = named(&docs, "PodDisruptionBudget", SERVICE);
    assert_eq!(pdb["metadata"]["namespace"].as_str(), Some(NAMESPACE));
    assert_eq!(pdb["spec"]["minAvailable"].as_u64(), Some(1));
    assert!(selects(&pdb["spec"]["selector"]));
    assert_eq!(pdb["spec"]["selector"], dep["spec"]["selector"]);

    let np = named(&docs, "NetworkPolicy", SERVICE);
    assert_eq!(np["metadata"]["namespace"].as_str(), Some(NAMESPACE));
    assert!(selects(&np["spec"]["podSelector"]));
    let ingress = np["spec"]["ingress"].as_sequence().unwrap();
    let port_of = |name: &str| {
        let p = c["ports"].as_sequence().unwrap().iter().find(|p| p["name"].as_str() == Some(name));
        p.and_then(|p| p["containerPort"].as_u64()).unwrap_or_else(|| panic!("container port {name}"))
    };
    let ports_of = |r: &Value| -> Vec<u64> {
        r["ports"].as_sequence().unwrap().iter().map(|p| p["port"].as_u64().unwrap()).collect()
    };
    // one rule: the verbs' port for the schedulers and the other replica. The metrics port
    // (--metrics-listen) admits the scrapers' namespaces the operator names, none by default; the
    // probe port (--probe-listen) nobody: kubelet's probes come from the node, always admitted
    assert_eq!(ingress.len(), 1, "{ingress:?}");
    assert_eq!(ports_of(&ingress[0]), [port_of("http")], "the verbs' port");
    let args: Vec<&str> = c["args"].as_sequence().unwrap().iter().filter_map(|a| a.as_str()).collect();
    assert!(args.contains(&format!("--metrics-listen=0.0.0.0:{}", port_of("metrics")).as_str()), "{args:?}");
    assert!(args.contains(&format!("--probe-listen=0.0.0.0:{}", port_of("probes")).as_str()), "{args:?}");
    let from: Vec<&Value> = ingress[0]["from"].as_sequence().unwrap().iter().collect();
    // a peer in another namespace is named by the label the API server sets on the namespace
    assert!(
        from.iter().all(|p| p["namespaceSelector"].is_null()
            || p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"].is_string()),
        "no namespace a tenant could label: {from:?}"
    );
    let dp_np = named(&docs, "NetworkPolicy", "gpuplace-device-plugin");
    assert!(
        dp_np["spec"]["ingress"].as_sequence().is_some_and(|i| i.is_empty()),
        "the device plugin's /metrics admits nobody by default: {dp_np:?}"
    );
    // a peer without namespaceSelector is in the policy's own namespace
    let same_ns = |p: &&Value| p["namespaceSelector"].is_null();
    assert!(
        from.iter().copied().filter(same_ns).any(|p| selects(&p["podSelector"])),
        "the other replica (the forward)"
    );
    let second = named(&docs, "Deployment", "gpuplace-scheduler");
    assert_eq!(second["metadata"]["namespace"].as_str(), Some(NAMESPACE));
    let second_labels = second["spec"]["template"]["metadata"]["labels"].as_mapping().unwrap();
    assert!(
        from.iter().copied().filter(same_ns).any(|p| p["podSelector"]["matchLabels"]
            .as_mapping()
            .is_some_and(|m| m.iter().all(|(k, v)| second_labels.get(k) == Some(v)))),
        "option A's scheduler"
    );
    assert!(
        from.iter().any(|p| p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"].as_str()
            == Some("kube-system")
            && p["podSelector"]["matchLabels"]["component"].as_str() == Some("kube-scheduler")),
        "kubeadm's kube-scheduler"
    );
}

#[test]
fn extender_deployment_service_and_device_plugin_agree_with_the_code() {
    let docs = documents();
    let port = serve_port();

    let svc = named(&docs, "Service", SERVICE);
    assert_eq!(svc["metadata"]["namespace"].as_str(), Some(NAMESPACE));
    assert_eq!(svc["spec"]["ports"][0]["port"].as_u64(), Some(port));

    let dep = named(&docs, "Deployment", SERVICE);
    assert_eq!(dep["metadata"]["namespace"].as_str(), Some(NAMESPACE));
    let c = &dep["spec"]["template"]["spec"]["containers"][0];
    assert_eq!(c["ports"][0]["containerPort"].as_u64(), Some(port));
    assert_eq!(c["ports"][0]["name"].as_str(), svc["spec"]["ports"][0]["targetPort"].as_str());
    let args: Vec<&str> = c["args"].as_sequence().unwrap().iter().map(|a| a.as_str().unwrap()).collect();
    assert_eq!(args[0], "serve");
    assert!(args.contains(&format!("--prefix={DEFAULT_PREFIX}").as_str()), "{args:?}");
    assert!(args.contains(&format!("--listen={DEFAULT_LISTEN}").as_str()), "{args:?}");
    let probes: Vec<&str> =
        ["readinessProbe", "livenessProbe"].iter().map(|p| c[*p]["httpGet"]["path"].as_str().unwrap()).collect();
    assert_eq!(probes, ["/readyz", "/healthz"]);
    // secure by default: mTLS with the extender's own CA, so the verbs' port asks every client for
    // a certificate and the probes go to the probe port (plain HTTP, no verb there, and no scraper:
    // issue 48)
    assert!(args.contains(&"--tls-ca-secret=gpuplace-extender-ca"), "{args:?}");
    for p in ["readinessProbe", "livenessProbe"] {
        assert_eq!(c[p]["httpGet"]["port"].as_str(), Some("probes"), "{p}");
        assert!(c[p]["httpGet"]["scheme"].is_null(), "{p}: plain HTTP");
    }

    // the probe paths are routes of a real server (static mode, the fixture cluster) and answer 200
    let cluster = load_cluster(&root().join("examples/clusters/fixture-cluster.yaml")).unwrap();
    let ext = Arc::new(harness::extender(cluster));
    let running = spawn(ext, HttpOptions::default(), "127.0.0.1:0", 1).expect("server starts");
    let mut conn = Connection::open(&running.addr.to_string(), Duration::from_secs(10)).unwrap();
    for path in probes {
        let r = conn.request("GET", path, b"").unwrap();
        assert_eq!(r.status, 200, "GET {path}: {}", r.text());
    }
    // the verbs of the urlPrefix are routes too: an empty body is a 400, not a 404
    for verb in ["filter", "prioritize", "bind", "preempt"] {
        let mut conn = Connection::open(&running.addr.to_string(), Duration::from_secs(10)).unwrap();
        let r = conn.request("POST", &format!("{DEFAULT_PREFIX}/{verb}"), b"").unwrap();
        assert_eq!(r.status, 400, "POST {verb}: {}", r.text());
    }

    let ds = named(&docs, "DaemonSet", "gpuplace-device-plugin");
    let pod = &ds["spec"]["template"]["spec"];
    let host_paths: Vec<&str> =
        pod["volumes"].as_sequence().unwrap().iter().filter_map(|v| v["hostPath"]["path"].as_str()).collect();
    assert!(host_paths.contains(&"/var/lib/kubelet/device-plugins"), "{host_paths:?}");
    assert!(host_paths.contains(&"/var/lib/kubelet/pod-resources"), "{host_paths:?}");
    let env = pod["containers"][0]["env"].as_sequence().unwrap();
    let node_name = env.iter().find(|e| e["name"].as_str() == Some("NODE_NAME")).expect("NODE_NAME");
    assert_eq!(node_name["valueFrom"]["fieldRef"]["fieldPath"].as_str(), Some("spec.nodeName"));
    // the utilization ConfigMaps' namespace is both binaries' default, one of its own, which the
    // Roles below grant and device-plugin/namespace.yaml creates
    assert!(env.iter().all(|e| e["name"].as_str() != Some("POD_NAMESPACE")), "the plugin reads no POD_NAMESPACE");
    assert_eq!(ds["metadata"]["namespace"].as_str(), Some(NAMESPACE));
    let util_ns = named(&docs, "Namespace", DEFAULT_UTILIZATION_NAMESPACE);
    assert_eq!(util_ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"].as_str(), Some("restricted"));
    assert_eq!(DEFAULT_NAMESPACE, NAMESPACE);
    let tolerated: Vec<&str> =
        pod["tolerations"].as_sequence().unwrap().iter().filter_map(|t| t["key"].as_str()).collect();
    assert!(tolerated.contains(&"nvidia.com/gpu") && tolerated.contains(&RESOURCE_GPU), "{tolerated:?}");

    // the device plugin's RBAC is exactly its calls (device-plugin/src/k8s/)
    let role = named(&docs, "ClusterRole", "gpuplace-device-plugin");
    let rules = role_rules(role);
    let want = [
        ("nodes", vec!["get", "patch"]),
        ("nodes/status", vec!["patch"]),
        ("pods", vec!["list", "watch", "patch"]),
        ("events", vec!["create", "patch"]),
    ];
    let want: Vec<(String, Vec<String>)> =
        want.iter().map(|(r, v)| (r.to_string(), v.iter().map(|s| s.to_string()).collect())).collect();
    assert_eq!(rules, want);

    // utilization ConfigMaps: the plugin creates and patches its own (device-plugin/src/k8s/utilization.rs),
    // the extender lists and watches them (src/apiserver/utilization.rs); Roles in their namespace
    for (role, account, verbs) in [
        ("gpuplace-device-plugin-utilization", "gpuplace-device-plugin", vec!["create", "patch"]),
        ("gpuplace-extender-utilization", SERVICE, vec!["list", "watch"]),
    ] {
        let r = named(&docs, "Role", role);
        assert_eq!(r["metadata"]["namespace"].as_str(), Some(DEFAULT_UTILIZATION_NAMESPACE), "{role}");
        let verbs: Vec<String> = verbs.into_iter().map(String::from).collect();
        assert_eq!(role_rules(r), [("configmaps".to_string(), verbs)], "{role}");
        let rule = &r["rules"][0];
        assert_eq!(rule["apiGroups"][0].as_str(), Some(""), "{role}: the core group");
        assert!(rule["resourceNames"].is_null(), "{role}: the names are per node, not listable here");
        let b = named(&docs, "RoleBinding", role);
        assert_eq!(b["metadata"]["namespace"].as_str(), Some(DEFAULT_UTILIZATION_NAMESPACE), "{role}");
        assert_eq!((b["roleRef"]["kind"].as_str(), b["roleRef"]["name"].as_str()), (Some("Role"), Some(role)));
        let subject = &b["subjects"][0];
        assert_eq!(subject["name"].as_str(), Some(account), "{role}");
        assert_eq!(subject["namespace"].as_str(), Some(NAMESPACE), "{role}");
    }

    // the extender's public keys: read by name only, where the extender publishes them
    let r = named(&docs, "Role", "gpuplace-device-plugin-public-keys");
    assert_eq!(r["metadata"]["namespace"].as_str(), Some(NAMESPACE));
    assert_eq!(role_rules(r), [("configmaps".to_string(), vec!["get".into(), "list".into(), "watch".into()])]);
    assert_eq!(r["rules"][0]["resourceNames"][0].as_str(), Some(DEFAULT_PUBLIC_KEYS_NAME));

    // every ServiceAccount a workload runs as exists, in its namespace
    for (k, name) in
        [("Deployment", SERVICE), ("DaemonSet", "gpuplace-device-plugin"), ("Deployment", "gpuplace-scheduler")]
    {
        let w = named(&docs, k, name);
        let sa = w["spec"]["template"]["spec"]["serviceAccountName"].as_str().unwrap();
        let acct = named(&docs, "ServiceAccount", sa);
        assert_eq!(acct["metadata"]["namespace"], w["metadata"]["namespace"], "{k} {name}");
    }
}

/// A Role's rules as (resource, verbs) pairs, in order.
fn role_rules(role: &Value) -> Vec<(String, Vec<String>)> {
    role["rules"]
        .as_sequence()
        .unwrap()
        .iter()
        .flat_map(|r| {
            let verbs: Vec<String> =
                r["verbs"].as_sequence().unwrap().iter().map(|v| v.as_str().unwrap().to_owned()).collect();
            r["resources"]
                .as_sequence()
                .unwrap()
                .iter()
                .map(move |res| (res.as_str().unwrap().to_owned(), verbs.clone()))
        })
        .collect()
}

/// The extender's access to its key Secret is exactly what `src/apiserver/keys.rs` does: create it
/// when absent (RBAC cannot name a create), read it by name only (GET; LIST and WATCH with the
/// field selector `metadata.name`, which is what lets `resourceNames` authorize them), and update
/// it once to upgrade a legacy ring; and it creates, reads and updates the public-key ConfigMap.
/// Nothing else may touch Secrets: the ClusterRole has no rule on them.
#[test]
fn the_extender_reads_only_its_key_secret() {
    let docs = documents();
    let secret = KeySecret::default();
    assert_eq!(secret.namespace, NAMESPACE);
    let role = named(&docs, "Role", "gpuplace-extender-assignment-keys");
    assert_eq!(role["metadata"]["namespace"].as_str(), Some(NAMESPACE));
    let strings = |v: &Value| -> Vec<String> {
        v.as_sequence().map(|s| s.iter().map(|x| x.as_str().unwrap().to_owned()).collect()).unwrap_or_default()
    };
    // (apiGroups, resources, resourceNames, verbs)
    type Rule = (Vec<String>, Vec<String>, Vec<String>, Vec<String>);
    let rules: Vec<Rule> = role["rules"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|r| {
            (strings(&r["apiGroups"]), strings(&r["resources"]), strings(&r["resourceNames"]), strings(&r["verbs"]))
        })
        .collect();
    let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    assert_eq!(
        rules,
        [
            (s(&[""]), s(&["secrets"]), s(&[]), s(&["create"])),
            (s(&[""]), s(&["secrets"]), s(&[DEFAULT_KEY_SECRET_NAME]), s(&["get", "list", "watch", "update"])),
            (s(&[""]), s(&["configmaps"]), s(&[]), s(&["create"])),
            (s(&[""]), s(&["configmaps"]), s(&[DEFAULT_PUBLIC_KEYS_NAME]), s(&["get", "update"])),
        ]
    );
    let b = named(&docs, "RoleBinding", "gpuplace-extender-assignment-keys");
    assert_eq!(b["metadata"]["namespace"].as_str(), Some(NAMESPACE));
    assert_eq!(
        (b["roleRef"]["kind"].as_str(), b["roleRef"]["name"].as_str()),
        (Some("Role"), Some("gpuplace-extender-assignment-keys"))
    );
    assert_eq!(
        (b["subjects"][0]["name"].as_str(), b["subjects"][0]["namespace"].as_str()),
        (Some(SERVICE), Some(NAMESPACE))
    );
    let cluster_role = named(&docs, "ClusterRole", SERVICE);
    for r in cluster_role["rules"].as_sequence().unwrap() {
        assert!(!strings(&r["resources"]).contains(&"secrets".to_string()), "the ClusterRole reads no Secret: {r:?}");
    }

    // mTLS by default: the CA read by name (never updated), kube-scheduler's Secret read and
    // written by name, under the names the code uses
    use gpuplace::k8s::certificates::{DEFAULT_CA_SECRET_NAME, DEFAULT_SCHEDULER_SECRET_NAME};
    let role = named(&docs, "Role", "gpuplace-extender-certificates");
    assert_eq!(role["metadata"]["namespace"].as_str(), Some(NAMESPACE));
    let rules: Vec<Rule> = role["rules"]
        .as_sequence()
        .unwrap()
        .iter()
        .map(|r| {
            (strings(&r["apiGroups"]), strings(&r["resources"]), strings(&r["resourceNames"]), strings(&r["verbs"]))
        })
        .collect();
    assert_eq!(
        rules,
        [
            (s(&[""]), s(&["secrets"]), s(&[]), s(&["create"])),
            (s(&[""]), s(&["secrets"]), s(&[DEFAULT_CA_SECRET_NAME]), s(&["get"])),
            (s(&[""]), s(&["secrets"]), s(&[DEFAULT_SCHEDULER_SECRET_NAME]), s(&["get", "update"])),
        ]
    );
    let b = named(&docs, "RoleBinding", "gpuplace-extender-certificates");
    assert_eq!(b["roleRef"]["name"].as_str(), Some("gpuplace-extender-certificates"));
    assert_eq!(b["subjects"][0]["name"].as_str(), Some(SERVICE));
}

/// The extender Deployment's `args:` parse with `gpuplace`'s own command-line definitions (the
/// device plugin's DaemonSet is checked in device-plugin/tests/cli.rs).
#[test]
fn the_extender_deployment_args_parse() {
    let docs = documents();
    let deployment = named(&docs, "Deployment", SERVICE);
    let containers = deployment["spec"]["template"]["spec"]["containers"].as_sequence().expect("containers");
    let mut checked = 0;
    for c in containers.iter().filter(|c| c["image"].as_str().is_some_and(|i| i.starts_with("gpuplace:"))) {
        let args: Vec<&str> = c["args"].as_sequence().expect("args").iter().filter_map(Value::as_str).collect();
        let out =
            std::process::Command::new(env!("CARGO_BIN_EXE_gpuplace")).args(&args).arg("--help").output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success() && !err.contains("error:"), "{args:?}: {err}");
        checked += 1;
    }
    assert_eq!(checked, 1, "one gpuplace container");
    // the check itself refuses what the binary refuses
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_gpuplace"))
        .args(["serve", "--no-such-flag", "--help"])
        .output()
        .unwrap();
    assert!(!out.status.success());
}
