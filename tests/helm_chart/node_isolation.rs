//! The chart's options of issue 49: the guard, managed MPS and the node's isolation mode.

use std::process::Command;

use serde_json::{json, Value};

use super::{chart, differences, find, helm, render, strings, values};

/// Managed MPS (issue 49): `--mps-daemon`, the MPS root at the host's path and its `shm/` as the
/// plugin's `/dev/shm` (the daemon's, which share containers get too), the driver's compute
/// binaries, and the capabilities to start servers as the clients' users; nothing else changes.
#[test]
fn managed_mps_adds_the_daemon_flag_its_directories_and_compute() {
    for (sets, root) in [
        (vec!["devicePlugin.mps.enabled=true"], "/run/gpuplace/mps"),
        (vec!["devicePlugin.mps.enabled=true", "devicePlugin.mps.root=/var/run/mps"], "/var/run/mps"),
    ] {
        let docs = render(&values(&sets));
        let ds = find(&docs, "DaemonSet", "gpuplace-device-plugin");
        let pod = &ds["spec"]["template"]["spec"];
        let c = &pod["containers"][0];
        let args = strings(&c["args"]);
        let mut want_args = vec!["serve".to_string(), "--mps-daemon".to_string()];
        if root != "/run/gpuplace/mps" {
            want_args.push(format!("--mps-root={root}"));
        }
        assert_eq!(args, want_args);
        let env = c["env"].as_array().unwrap();
        let caps = env.iter().find(|e| e["name"] == "NVIDIA_DRIVER_CAPABILITIES").expect("capabilities");
        assert_eq!(caps["value"], "compute,utility");
        assert_eq!(
            strings(&c["securityContext"]["capabilities"]["add"]),
            ["KILL", "SETUID", "SETGID"],
            "the guard's and the daemon's"
        );
        let mount = |path: &str| -> Value {
            let m = c["volumeMounts"].as_array().unwrap().iter().find(|m| m["mountPath"] == path);
            let m = m.unwrap_or_else(|| panic!("a mount at {path}"));
            let v = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == m["name"]);
            v.unwrap_or_else(|| panic!("the volume of {path}"))["hostPath"].clone()
        };
        assert_eq!(mount(root), json!({"path": root, "type": "DirectoryOrCreate"}));
        assert_eq!(mount("/dev/shm"), json!({"path": format!("{root}/shm"), "type": "DirectoryOrCreate"}));

        // the rest is the default DaemonSet
        let mut want = find(&render(&[]), "DaemonSet", "gpuplace-device-plugin").clone();
        let wc = &mut want["spec"]["template"]["spec"]["containers"][0];
        wc["args"] = c["args"].clone();
        wc["env"] = c["env"].clone();
        wc["securityContext"] = c["securityContext"].clone();
        wc["volumeMounts"] = c["volumeMounts"].clone();
        want["spec"]["template"]["spec"]["volumes"] = pod["volumes"].clone();
        let mut d = Vec::new();
        differences("", &want, ds, &mut d);
        assert!(d.is_empty(), "managed MPS changes more than its own parts:\n{}", d.join("\n"));
    }
}

/// Issue 49: `devicePlugin.isolation` (default `auto`: no flag, so the default rendering stays the
/// plain manifest) and `devicePlugin.contextOverheadMib` (default null: no flag) become the plugin's
/// `--isolation` and `--context-overhead-mib`; a mode the plugin does not know is refused by the
/// chart's schema.
#[test]
fn the_isolation_mode_and_the_context_overhead_are_flags_only_when_set() {
    let args_of = |sets: &[&str]| {
        let docs = render(&values(sets));
        strings(
            &find(&docs, "DaemonSet", "gpuplace-device-plugin")["spec"]["template"]["spec"]["containers"][0]["args"],
        )
    };
    let plain = args_of(&[]);
    assert!(
        !plain.iter().any(|a| a.starts_with("--isolation") || a.starts_with("--context-overhead-mib")),
        "{plain:?}"
    );
    assert_eq!(args_of(&["devicePlugin.isolation=auto"]), plain);
    let set = args_of(&["devicePlugin.isolation=guard", "devicePlugin.contextOverheadMib=768"]);
    assert!(set.contains(&"--isolation=guard".to_string()), "{set:?}");
    assert!(set.contains(&"--context-overhead-mib=768".to_string()), "{set:?}");
    assert_eq!(set.len(), plain.len() + 2);
    let mut args = vec!["template".to_string(), "gpuplace".to_string(), chart().display().to_string()];
    args.extend(values(&["devicePlugin.isolation=strict"]));
    let out = Command::new(helm()).args(&args).output().unwrap();
    assert!(!out.status.success(), "a mode the plugin does not know renders");
    assert!(String::from_utf8_lossy(&out.stderr).contains("isolation"), "{}", String::from_utf8_lossy(&out.stderr));
}

/// The guard (issue 49): on by default with `hostPID` and the KILL capability and no API grant;
/// disabled, `--no-guard` and neither; `evict` adds the flag and `pods/eviction` create.
#[test]
fn the_guard_is_on_by_default_and_evicting_needs_its_own_grant() {
    let dp = |docs: &[Value]| find(docs, "DaemonSet", "gpuplace-device-plugin")["spec"]["template"]["spec"].clone();
    let evicts = |docs: &[Value]| {
        find(docs, "ClusterRole", "gpuplace-device-plugin")["rules"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| strings(&r["resources"]).contains(&"pods/eviction".to_string()))
    };
    let on = render(&values(&[]));
    let spec = dp(&on);
    assert_eq!(spec["hostPID"], true);
    assert_eq!(strings(&spec["containers"][0]["securityContext"]["capabilities"]["add"]), ["KILL"]);
    assert!(!strings(&spec["containers"][0]["args"]).iter().any(|a| a.starts_with("--guard") || a == "--no-guard"));
    assert!(!evicts(&on), "kill needs no eviction grant");

    let off = render(&values(&["devicePlugin.guard.enabled=false"]));
    let spec = dp(&off);
    assert!(spec["hostPID"].is_null(), "{}", spec["hostPID"]);
    assert!(spec["containers"][0]["securityContext"]["capabilities"]["add"].is_null());
    assert!(strings(&spec["containers"][0]["args"]).contains(&"--no-guard".to_string()));

    let evict = render(&values(&["devicePlugin.guard.action=evict", "devicePlugin.guard.grace=30s"]));
    let args = strings(&dp(&evict)["containers"][0]["args"]);
    assert!(
        args.contains(&"--guard-action=evict".to_string()) && args.contains(&"--guard-grace=30s".to_string()),
        "{args:?}"
    );
    assert!(evicts(&evict));
}

/// Driver limits (issue 49, item 3): off by default (the default rendering stays the plain
/// manifest); on, `--driver-limits` and the host's `/sys/fs/cgroup` at its own path, read-write,
/// and nothing else.
#[test]
fn driver_limits_add_their_flag_and_the_hosts_cgroup_tree() {
    let docs = render(&values(&["devicePlugin.driverLimits.enabled=true"]));
    let ds = find(&docs, "DaemonSet", "gpuplace-device-plugin");
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(strings(&c["args"]), ["serve", "--driver-limits"]);
    let m = c["volumeMounts"].as_array().unwrap().iter().find(|m| m["mountPath"] == "/sys/fs/cgroup").expect("mount");
    assert_ne!(m["readOnly"], json!(true), "the driver's limits are cgroup files");
    let v = pod["volumes"].as_array().unwrap().iter().find(|v| v["name"] == m["name"]).expect("volume");
    assert_eq!(v["hostPath"], json!({"path": "/sys/fs/cgroup", "type": "Directory"}));

    let mut want = find(&render(&[]), "DaemonSet", "gpuplace-device-plugin").clone();
    let wc = &mut want["spec"]["template"]["spec"]["containers"][0];
    wc["args"] = c["args"].clone();
    wc["volumeMounts"] = c["volumeMounts"].clone();
    want["spec"]["template"]["spec"]["volumes"] = pod["volumes"].clone();
    let mut d = Vec::new();
    differences("", &want, ds, &mut d);
    assert!(d.is_empty(), "driver limits change more than their own parts:\n{}", d.join("\n"));
    let default = find(&render(&[]), "DaemonSet", "gpuplace-device-plugin").clone();
    assert!(!strings(&default["spec"]["template"]["spec"]["containers"][0]["args"])
        .contains(&"--driver-limits".to_string()));
}
