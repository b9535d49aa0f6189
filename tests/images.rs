//! images/Containerfile and images/build.sh agree with the workspace and with the manifests in
//! scheduler-config/: build.sh compiles the workspace's binaries with `--locked` and a profile that
//! strips debug info, both images start FROM scratch and copy only what build.sh assembles into the
//! build context, and each image's user, port, entry point and default arguments are what the
//! Deployment and the DaemonSet expect. No builder needed here; the e2e suite builds both images
//! with build.sh and runs them under a real kubelet (tests/e2e/real_node.rs). The device plugin's
//! default arguments are parsed by its own binary in device-plugin/tests/image.rs.

#[path = "support/cargo_tree.rs"]
mod cargo_tree;
#[path = "support/dockerfile.rs"]
mod dockerfile;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use cargo_tree::resolved;
use dockerfile::{copy_parts, exists, parse, read, repo_root, stage, Stage};
use gpuplace::extender::http::DEFAULT_LISTEN;
use serde_norway::Value;

const CONTAINERFILE: &str = "images/Containerfile";
const BUILD_SH: &str = "images/build.sh";

fn stages() -> Vec<Stage> {
    parse(&read(CONTAINERFILE))
}

/// The workspace's binaries, from `cargo metadata`.
struct Workspace {
    bins: BTreeSet<String>,
}

fn workspace() -> Workspace {
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--format-version", "1", "--no-deps", "--offline"])
        .current_dir(repo_root())
        .output()
        .expect("cargo runs");
    assert!(out.status.success(), "cargo metadata: {}", String::from_utf8_lossy(&out.stderr));
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).expect("cargo metadata's JSON");
    let members: BTreeSet<&str> =
        meta["workspace_members"].as_array().unwrap().iter().map(|m| m.as_str().unwrap()).collect();
    let mut ws = Workspace { bins: BTreeSet::new() };
    for p in meta["packages"].as_array().unwrap().iter().filter(|p| members.contains(p["id"].as_str().unwrap())) {
        for t in p["targets"].as_array().unwrap() {
            let kinds: Vec<&str> = t["kind"].as_array().unwrap().iter().map(|k| k.as_str().unwrap()).collect();
            if kinds.contains(&"bin") {
                ws.bins.insert(t["name"].as_str().unwrap().to_string());
            }
        }
    }
    assert!(ws.bins.len() >= 2, "{:?}", ws.bins);
    ws
}

/// `key = value` lines of one `[section]` of a TOML file (values as written).
fn toml_section(text: &str, section: &str) -> BTreeMap<String, String> {
    let header = format!("[{section}]");
    text.lines()
        .skip_while(|l| l.trim() != header)
        .skip(1)
        .take_while(|l| !l.trim_start().starts_with('['))
        .filter(|l| !l.trim_start().starts_with('#'))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim().to_string(), v.trim().to_string()))
        .collect()
}

fn manifest(rel: &str) -> Value {
    serde_norway::from_str(&read(rel)).unwrap_or_else(|e| panic!("{rel}: {e}"))
}

/// `(uid, gid)` from `USER uid:gid`; numeric, so that kubelet can check `runAsNonRoot`.
fn user(s: &Stage) -> (u64, u64) {
    let u = s.one("USER");
    let (uid, gid) = u.split_once(':').unwrap_or_else(|| panic!("stage {}: USER {u} without a group", s.name));
    (uid.parse().expect("numeric uid"), gid.parse().expect("numeric gid"))
}

fn exposed(s: &Stage) -> Vec<u64> {
    s.all("EXPOSE")
        .iter()
        .flat_map(|e| e.split_whitespace())
        .map(|p| p.trim_end_matches("/tcp").parse().expect("a port"))
        .collect()
}

/// The one binary a stage copies from the context's `bin/`: (binary, where it goes).
fn copied_binary(s: &Stage) -> (String, String) {
    let bins: Vec<_> = s
        .all("COPY")
        .into_iter()
        .map(copy_parts)
        .filter(|(_, src, _)| src.iter().any(|p| p.starts_with("bin/")))
        .collect();
    assert_eq!(bins.len(), 1, "stage {}: {bins:?}", s.name);
    let (_, src, dest) = &bins[0];
    assert_eq!(src.len(), 1, "stage {}: {src:?}", s.name);
    (src[0].trim_start_matches("bin/").to_string(), dest.clone())
}

/// A bash array of build.sh, `name=(a b)`, its words unquoted.
fn script_array(script: &str, name: &str) -> Vec<String> {
    let line = script
        .lines()
        .find_map(|l| l.trim().strip_prefix(&format!("{name}=(")))
        .unwrap_or_else(|| panic!("build.sh has no {name}=(...)"));
    line.trim_end_matches(')').split_whitespace().map(|w| w.trim_matches('"').to_string()).collect()
}

/// The image name images/build.sh gives a target with its default tag and no registry prefix.
fn built_tag(target: &str) -> String {
    let script = read(BUILD_SH);
    let default_tag = script
        .lines()
        .find_map(|l| l.trim().strip_prefix("tag=${TAG:-"))
        .and_then(|r| r.split_once('}'))
        .map(|(t, _)| t.to_string())
        .expect("build.sh: tag=${TAG:-...}");
    let targets = script_array(&script, "targets");
    let names = script_array(&script, "names");
    assert_eq!(targets.len(), names.len(), "build.sh: one name per target");
    let at = targets.iter().position(|t| t == target).unwrap_or_else(|| panic!("build.sh builds no {target}"));
    names[at].replace("${registry}", "").replace("${tag}", &default_tag)
}

/// The container's effective `securityContext` field: the container's own, else the pod's.
fn security<'a>(pod: &'a Value, container: &'a Value, field: &str) -> &'a Value {
    let own = &container["securityContext"][field];
    if own.is_null() {
        &pod["securityContext"][field]
    } else {
        own
    }
}

#[test]
fn the_build_script_compiles_the_workspace_binaries_locked_and_stripped() {
    let script = read(BUILD_SH);
    let cargo: Vec<&str> = script
        .lines()
        .map(str::trim)
        .find(|l| l.starts_with("cargo build"))
        .expect("build.sh: cargo build")
        .split_whitespace()
        .collect();
    for flag in ["--release", "--locked", "--workspace", "--bins"] {
        assert!(cargo.contains(&flag), "{flag} missing: {cargo:?}");
    }
    // the release profile strips debug info, and compiles none
    let cargo_toml = read("Cargo.toml");
    let settings = toml_section(&cargo_toml, "profile.release");
    let strip = settings.get("strip").map(String::as_str);
    assert!(matches!(strip, Some("\"debuginfo\"" | "\"symbols\"" | "true")), "[profile.release] strip: {strip:?}");
    let debug = settings.get("debug").map(String::as_str);
    assert!(matches!(debug, None | Some("0" | "false" | "\"none\"")), "[profile.release] debug: {debug:?}");
    // and profiling keeps what the stripped profile drops (docs/performance.md)
    let profiling = toml_section(&cargo_toml, "profile.profiling");
    assert_eq!(profiling.get("inherits").map(String::as_str), Some("\"release\""), "{profiling:?}");
    assert!(!matches!(profiling.get("debug").map(String::as_str), None | Some("0" | "false")), "{profiling:?}");
    assert!(matches!(profiling.get("strip").map(String::as_str), Some("\"none\"" | "false")), "{profiling:?}");

    // build.sh takes exactly the workspace's binaries, and each image copies one of them
    let ws = workspace();
    let bins: BTreeSet<String> = script_array(&script, "bins").into_iter().collect();
    assert_eq!(bins, ws.bins, "build.sh's bins");
    let taken: BTreeSet<String> = stages().iter().map(|s| copied_binary(s).0).collect();
    assert_eq!(taken, ws.bins, "each binary in one image");
    assert_eq!(stages().len(), ws.bins.len());
}

#[test]
fn the_images_start_from_scratch_and_copy_only_what_build_sh_assembles() {
    let script = read(BUILD_SH);
    for s in &stages() {
        // nothing pulled, and nothing run: buildah needs no runtime and no network to build them
        assert_eq!(s.base, "scratch", "stage {}", s.name);
        assert!(s.all("RUN").is_empty(), "stage {}: RUN needs a base with a shell", s.name);
        for (from, sources, _) in s.all("COPY").into_iter().map(copy_parts) {
            assert!(from.is_none(), "stage {}: COPY --from", s.name);
            for src in sources {
                let ok = if src == "base/" {
                    script.contains("base=$ctx/base")
                } else if let Some(bin) = src.strip_prefix("bin/") {
                    script_array(&script, "bins").iter().any(|b| b == bin)
                } else {
                    // repository files build.sh copies into the context as they are
                    exists(&src) && script.contains(&format!("cp -r {src} \"$ctx/{src}\""))
                };
                assert!(ok, "stage {}: COPY {src}: build.sh does not put it in the context", s.name);
            }
        }
    }
    // the base is what the binaries need: their libraries (ldd), CA certificates, the users
    for need in ["ldd \"$ctx/bin/$b\"", "ca-certificates.crt", "/etc/passwd", "/etc/group", "65532"] {
        assert!(script.contains(need), "build.sh: {need}");
    }
    assert!(!exists("images/Dockerfile") && !exists(".dockerignore"), "one build definition");
}

#[test]
fn the_extender_image_is_what_the_deployment_runs() {
    let stages = stages();
    let s = stage(&stages, "extender");
    let dep = manifest("scheduler-config/extender/deployment.yaml");
    let pod = &dep["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(c["image"].as_str(), Some(built_tag("extender").as_str()), "images/build.sh's tag");

    let (uid, gid) = user(s);
    assert_ne!(uid, 0, "the extender runs as non-root");
    assert_eq!(security(pod, c, "runAsNonRoot").as_bool(), Some(true));
    assert_eq!(security(pod, c, "runAsUser").as_u64(), Some(uid));
    assert_eq!(security(pod, c, "runAsGroup").as_u64(), Some(gid));

    // the exposed ports are the Deployment's container ports: `serve`'s default (the verbs), the
    // metrics port, and the probe port the probes use (no tenant reaches it, issue 48)
    let port = exposed(s);
    let container_ports: Vec<u64> =
        c["ports"].as_sequence().unwrap().iter().map(|p| p["containerPort"].as_u64().unwrap()).collect();
    assert_eq!(port, container_ports);
    for probe in ["readinessProbe", "livenessProbe"] {
        let name = c[probe]["httpGet"]["port"].as_str().expect("a named port");
        let p = c["ports"].as_sequence().unwrap().iter().find(|p| p["name"].as_str() == Some(name)).unwrap();
        assert_eq!(
            name, "probes",
            "{probe}: the verbs' port asks for a client certificate, the metrics port is scraped"
        );
        assert!(port.contains(&p["containerPort"].as_u64().unwrap()), "{probe}");
    }
    assert_eq!(port[0].to_string(), DEFAULT_LISTEN.rsplit(':').next().unwrap());

    // the Deployment's args replace CMD after the image's entry point, which is the copied binary
    assert!(c["command"].is_null(), "a command would replace the ENTRYPOINT");
    let entry = s.exec("ENTRYPOINT");
    assert_eq!(entry, [copied_binary(s).1]);
    let bin = Path::new(env!("CARGO_BIN_EXE_gpuplace"));
    assert_eq!(Path::new(&entry[0]).file_name(), bin.file_name());
    let cmd = s.exec("CMD");
    let out = Command::new(bin).args(&cmd).arg("--help").output().unwrap();
    assert!(out.status.success(), "CMD {cmd:?}: {}", String::from_utf8_lossy(&out.stderr));

    // `simulate` looks for its bundled example under the working directory: the image keeps the
    // repository's layout there
    let demo: Vec<_> = s
        .all("COPY")
        .into_iter()
        .map(copy_parts)
        .filter(|(_, src, _)| src.iter().any(|p| p.starts_with("examples/")))
        .collect();
    assert_eq!(demo.len(), 1, "{demo:?}");
    assert_eq!(demo[0].2, format!("{}/{}", s.one("WORKDIR"), demo[0].1[0]));
}

#[test]
fn the_device_plugin_image_is_what_the_daemonset_runs() {
    let stages = stages();
    let s = stage(&stages, "device-plugin");
    let ds = manifest("scheduler-config/device-plugin/daemonset.yaml");
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(c["image"].as_str(), Some(built_tag("device-plugin").as_str()), "images/build.sh's tag");

    // root (the Containerfile says why), as the DaemonSet sets it
    let (uid, gid) = user(s);
    assert_eq!((uid, gid), (0, 0));
    assert_eq!(security(pod, c, "runAsUser").as_u64(), Some(uid));
    assert_eq!(security(pod, c, "allowPrivilegeEscalation").as_bool(), Some(false));

    let metrics = c["ports"].as_sequence().unwrap().iter().find(|p| p["name"].as_str() == Some("metrics")).unwrap();
    assert_eq!(exposed(s), [metrics["containerPort"].as_u64().unwrap()]);

    // the image's NVIDIA toolkit defaults are the DaemonSet's values
    let env: BTreeMap<&str, &str> = s.one("ENV").split_whitespace().filter_map(|kv| kv.split_once('=')).collect();
    let mut nvidia = 0;
    for e in c["env"].as_sequence().unwrap() {
        let name = e["name"].as_str().unwrap();
        if name.starts_with("NVIDIA_") {
            assert_eq!(env.get(name).copied(), e["value"].as_str(), "{name}");
            nvidia += 1;
        }
    }
    assert_eq!(nvidia, env.len(), "{env:?}");

    assert!(c["command"].is_null(), "a command would replace the ENTRYPOINT");
    let entry = s.exec("ENTRYPOINT");
    assert_eq!(entry, [copied_binary(s).1]);
    assert_eq!(Path::new(&entry[0]).file_name().unwrap(), "gpuplace-device-plugin");
}

/// The reader itself: continuations and comments inside them.
#[test]
fn the_containerfile_reader_follows_docker() {
    let stages = parse(
        "# syntax=docker/dockerfile:1\nARG V=1.2\nFROM img:${V}-x AS a\nRUN one \\\n  # note\n  two \\\n\n  three\nFROM a\nCMD [\"x\", \"y\"]\n",
    );
    assert_eq!(stages.len(), 2);
    assert_eq!((stages[0].name.as_str(), stages[0].base.as_str()), ("a", "img:1.2-x"));
    assert_eq!(stages[0].one("RUN"), "one two three");
    assert_eq!(stages[1].exec("CMD"), ["x", "y"]);
}

/// `cargo build --release` of the root package after `cargo build --release --workspace` (and a
/// narrow `cargo test -p gpuplace` after `cargo test --workspace`) compiles nothing again: every
/// dependency of the root package is built with the features the whole workspace turns on, since
/// the root package asks for the device plugin's features itself (Cargo.toml, tokio).
#[test]
fn the_root_package_builds_its_dependencies_as_the_workspace_does() {
    for edges in ["normal", "normal,build,dev"] {
        let root = resolved(edges, &["-p", "gpuplace"]);
        let workspace = resolved(edges, &["--workspace"]);
        let differ: Vec<&String> = root.difference(&workspace).collect();
        assert!(differ.is_empty(), "-e {edges}: features of the root package alone, not the workspace's: {differ:#?}");
        assert!(root.iter().any(|l| l.starts_with("tokio v")), "{root:?}");
    }
}
