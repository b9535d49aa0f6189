//! images/Dockerfile, images/build.sh and .dockerignore agree with the workspace and with the
//! manifests in scheduler-config/: the build stage compiles the workspace's binaries with `--locked`
//! and a profile that strips debug info, copies only paths that exist and that the build context
//! admits, and each image's user, port, entry point and default arguments are what the Deployment
//! and the DaemonSet expect. No Docker daemon needed (there is none on CI); the device plugin's
//! default arguments are parsed by its own binary in device-plugin/tests/image.rs.

#[path = "support/cargo_tree.rs"]
mod cargo_tree;
#[path = "support/dockerfile.rs"]
mod dockerfile;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Command;

use cargo_tree::resolved;
use dockerfile::{copy_parts, exists, parse, read, repo_root, run_commands, stage, IgnoreFile, Stage};
use gpuplace::extender::http::DEFAULT_LISTEN;
use serde_norway::Value;

const DOCKERFILE: &str = "images/Dockerfile";

fn stages() -> Vec<Stage> {
    parse(&read(DOCKERFILE))
}

/// What `cargo metadata` says of the workspace: its binaries, and the source files a build of it
/// reads by path (libraries, binaries, build scripts, and bench targets, which Cargo.toml declares
/// and so must exist), relative to the repository root.
struct Workspace {
    bins: BTreeSet<String>,
    build_paths: Vec<String>,
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
    let root = repo_root();
    let mut ws = Workspace { bins: BTreeSet::new(), build_paths: Vec::new() };
    for p in meta["packages"].as_array().unwrap().iter().filter(|p| members.contains(p["id"].as_str().unwrap())) {
        let manifest = Path::new(p["manifest_path"].as_str().unwrap());
        ws.build_paths.push(manifest.strip_prefix(&root).unwrap().display().to_string());
        for t in p["targets"].as_array().unwrap() {
            let kinds: Vec<&str> = t["kind"].as_array().unwrap().iter().map(|k| k.as_str().unwrap()).collect();
            if kinds.contains(&"bin") {
                ws.bins.insert(t["name"].as_str().unwrap().to_string());
            }
            if kinds.iter().any(|k| ["lib", "bin", "custom-build", "bench"].contains(k)) {
                let src = Path::new(t["src_path"].as_str().unwrap());
                ws.build_paths.push(src.strip_prefix(&root).unwrap().display().to_string());
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

/// The one binary a runtime stage copies from the build stage, and where it puts it.
fn copied_binary(s: &Stage) -> String {
    let from_build: Vec<_> = s.all("COPY").into_iter().map(copy_parts).filter(|(f, _, _)| f.is_some()).collect();
    assert_eq!(from_build.len(), 1, "stage {}: {from_build:?}", s.name);
    from_build[0].2.clone()
}

/// The image name images/build.sh gives a target with its default tag and no registry prefix.
fn built_tag(target: &str) -> String {
    let script = read("images/build.sh");
    let default_tag = script
        .lines()
        .find_map(|l| l.trim().strip_prefix("tag=\"${TAG:-"))
        .and_then(|r| r.split_once('}'))
        .map(|(t, _)| t.to_string())
        .expect("build.sh: tag=\"${TAG:-...}\"");
    let line = script
        .lines()
        .find(|l| l.contains("docker build") && l.contains(&format!("--target {target} ")))
        .unwrap_or_else(|| panic!("build.sh builds no --target {target}"));
    let words: Vec<&str> = line.split_whitespace().collect();
    let at = words.iter().position(|w| *w == "-t").expect("-t");
    words[at + 1].trim_matches('"').replace("${registry}", "").replace("${tag}", &default_tag)
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
fn the_build_stage_compiles_the_workspace_binaries_locked_and_stripped() {
    let stages = stages();
    let build = stage(&stages, "build");
    let commands = run_commands(build.one("RUN"));
    let cargo = commands
        .iter()
        .find(|c| c.len() > 1 && c[0] == "cargo" && c[1] == "build")
        .unwrap_or_else(|| panic!("no cargo build in {commands:?}"));
    for flag in ["--locked", "--workspace", "--bins"] {
        assert!(cargo.contains(&flag.to_string()), "{flag} missing: {cargo:?}");
    }
    let profile = if cargo.contains(&"--release".to_string()) {
        "release".to_string()
    } else {
        let at = cargo.iter().position(|w| w == "--profile").expect("--release or --profile");
        cargo[at + 1].clone()
    };

    // the profile strips debug info, and compiles none
    let cargo_toml = read("Cargo.toml");
    let settings = toml_section(&cargo_toml, &format!("profile.{profile}"));
    let strip = settings.get("strip").map(String::as_str);
    assert!(matches!(strip, Some("\"debuginfo\"" | "\"symbols\"" | "true")), "[profile.{profile}] strip: {strip:?}");
    let debug = settings.get("debug").map(String::as_str);
    assert!(matches!(debug, None | Some("0" | "false" | "\"none\"")), "[profile.{profile}] debug: {debug:?}");
    // and profiling keeps what the stripped profile drops (docs/performance.md)
    let profiling = toml_section(&cargo_toml, "profile.profiling");
    assert_eq!(profiling.get("inherits").map(String::as_str), Some("\"release\""), "{profiling:?}");
    assert!(!matches!(profiling.get("debug").map(String::as_str), None | Some("0" | "false")), "{profiling:?}");
    assert!(matches!(profiling.get("strip").map(String::as_str), Some("\"none\"" | "false")), "{profiling:?}");

    // it copies out exactly the workspace's binaries, and the runtime stages take each of them once
    let mut installed = BTreeMap::new();
    for c in commands.iter().filter(|c| c[0] == "install") {
        let (src, dst) = (&c[c.len() - 2], &c[c.len() - 1]);
        let bin = src.strip_prefix(&format!("target/{profile}/")).unwrap_or_else(|| panic!("{src}: not built here"));
        installed.insert(bin.to_string(), dst.clone());
    }
    let ws = workspace();
    assert_eq!(installed.keys().cloned().collect::<BTreeSet<_>>(), ws.bins);
    let mut taken: Vec<String> = Vec::new();
    for s in stages.iter().filter(|s| s.name != "build") {
        for (from, sources, _) in s.all("COPY").into_iter().map(copy_parts) {
            if from.as_deref() == Some("build") {
                assert!(
                    sources.iter().all(|src| installed.values().any(|d| d == src)),
                    "stage {}: {sources:?}",
                    s.name
                );
                taken.extend(sources);
            }
        }
    }
    taken.sort();
    let mut want: Vec<String> = installed.values().cloned().collect();
    want.sort();
    assert_eq!(taken, want, "each binary in one image");

    // glibc: the builder's Debian release is the runtime images'
    let codename = ["bookworm", "trixie"]
        .into_iter()
        .find(|c| build.base.ends_with(&format!("-{c}")))
        .unwrap_or_else(|| panic!("builder {}: name the Debian release", build.base));
    let debian = if codename == "bookworm" { "debian12" } else { "debian13" };
    for s in stages.iter().filter(|s| s.name != "build") {
        assert!(s.base.contains(debian), "stage {} on {} with a {codename} builder", s.name, s.base);
    }
}

#[test]
fn the_build_context_holds_what_the_images_copy_and_no_more() {
    let ignore = IgnoreFile::parse(&read(".dockerignore"));
    let stages = stages();
    let mut copied: Vec<String> = Vec::new();
    for s in &stages {
        for (from, sources, _) in s.all("COPY").into_iter().map(copy_parts) {
            if from.is_none() {
                for src in sources {
                    assert!(exists(&src), "stage {}: COPY {src}: not in the repository", s.name);
                    assert!(!ignore.excludes(&src), "stage {}: COPY {src}: .dockerignore leaves it out", s.name);
                    copied.push(src);
                }
            }
        }
    }
    // every file the workspace build reads by path is copied into the build stage
    let build = stage(&stages, "build");
    let build_copied: Vec<String> = build
        .all("COPY")
        .into_iter()
        .map(copy_parts)
        .flat_map(|(_, sources, _)| sources)
        .map(|s| s.trim_end_matches('/').to_string())
        .collect();
    for path in workspace().build_paths {
        let under = build_copied.iter().any(|c| path == *c || path.starts_with(&format!("{c}/")));
        assert!(under, "{path}: the build reads it, the build stage does not copy it ({build_copied:?})");
        assert!(!ignore.excludes(&path), "{path}: left out of the context");
    }
    assert!(exists("device-plugin/proto"), "the device plugin's protos, under a copied folder");
    for out in ["target", "target/release/gpuplace", ".git", ".git/HEAD", "device-plugin/target/debug/x"] {
        assert!(ignore.excludes(out), "{out} is sent to the daemon");
    }
    // nor what the build does not read
    for out in ["docs/deploy.md", "tests/images.rs", "scheduler-config/extender/deployment.yaml"] {
        assert!(ignore.excludes(out), "{out} is sent to the daemon");
    }
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

    // the exposed port is the container port the probes use, and `serve`'s default
    let port = exposed(s);
    for probe in ["readinessProbe", "livenessProbe"] {
        let name = c[probe]["httpGet"]["port"].as_str().expect("a named port");
        let p = c["ports"].as_sequence().unwrap().iter().find(|p| p["name"].as_str() == Some(name)).unwrap();
        assert_eq!(port, [p["containerPort"].as_u64().unwrap()], "{probe}");
    }
    assert_eq!(port[0].to_string(), DEFAULT_LISTEN.rsplit(':').next().unwrap());

    // the Deployment's args replace CMD after the image's entry point, which is the copied binary
    assert!(c["command"].is_null(), "a command would replace the ENTRYPOINT");
    let entry = s.exec("ENTRYPOINT");
    assert_eq!(entry, [copied_binary(s)]);
    let bin = Path::new(env!("CARGO_BIN_EXE_gpuplace"));
    assert_eq!(Path::new(&entry[0]).file_name(), bin.file_name());
    let cmd = s.exec("CMD");
    let out = Command::new(bin).args(&cmd).arg("--help").output().unwrap();
    assert!(out.status.success(), "CMD {cmd:?}: {}", String::from_utf8_lossy(&out.stderr));

    // `simulate` looks for its bundled example under the working directory: the image keeps the
    // repository's layout there
    let demo: Vec<_> = s.all("COPY").into_iter().map(copy_parts).filter(|(f, _, _)| f.is_none()).collect();
    assert_eq!(demo.len(), 1, "{demo:?}");
    assert_eq!(demo[0].1, [demo[0].2.clone()]);
    assert!(s.all("WORKDIR").len() == 1 && !s.one("WORKDIR").is_empty());
}

#[test]
fn the_device_plugin_image_is_what_the_daemonset_runs() {
    let stages = stages();
    let s = stage(&stages, "device-plugin");
    let ds = manifest("scheduler-config/device-plugin/daemonset.yaml");
    let pod = &ds["spec"]["template"]["spec"];
    let c = &pod["containers"][0];
    assert_eq!(c["image"].as_str(), Some(built_tag("device-plugin").as_str()), "images/build.sh's tag");

    // root (the Dockerfile says why), as the DaemonSet sets it
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
    assert_eq!(entry, [copied_binary(s)]);
    assert_eq!(Path::new(&entry[0]).file_name().unwrap(), "gpuplace-device-plugin");
}

/// The reader itself: continuations, comments inside them, and ignore-file precedence.
#[test]
fn the_dockerfile_reader_follows_docker() {
    let stages = parse(
        "# syntax=docker/dockerfile:1\nARG V=1.2\nFROM img:${V}-x AS a\nRUN one \\\n  # note\n  two \\\n\n  three\nFROM a\nCMD [\"x\", \"y\"]\n",
    );
    assert_eq!(stages.len(), 2);
    assert_eq!((stages[0].name.as_str(), stages[0].base.as_str()), ("a", "img:1.2-x"));
    assert_eq!(stages[0].one("RUN"), "one two three");
    assert_eq!(stages[1].exec("CMD"), ["x", "y"]);
    let ignore = IgnoreFile::parse("*\n!src/\n**/target/\n!keep/*.md\n");
    assert!(ignore.excludes("README.md") && ignore.excludes("docs/a.md"));
    assert!(!ignore.excludes("src") && !ignore.excludes("src/main.rs"));
    assert!(ignore.excludes("src/target/x") && ignore.excludes("target"));
    assert!(!ignore.excludes("keep/a.md") && ignore.excludes("keep/a.rs"));
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
