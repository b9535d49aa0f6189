//! What a container is told about its GPUs: the environment of gpuplace's contract
//! (docs/device-plugin.md, "Allocate and pod identity"), the same whether the GPUs came from the
//! device plugin's Allocate or from a DRA claim's NodePrepareResources (pure).

use std::path::PathBuf;

/// How share containers reach the node's MPS control daemon.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsConnect {
    /// The daemon's pipe directory, at the same path on the host and in the container.
    pub pipe_dir: PathBuf,
    /// The host directory that is the daemon's `/dev/shm`, to be the container's too (MPS clients
    /// and server exchange POSIX shared memory); `None` when the operator shares it otherwise.
    pub shm_dir: Option<PathBuf>,
}

/// A host directory mounted into the container.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostMount {
    pub host_path: String,
    pub container_path: String,
}

/// One GPU's share in a container.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuLimit {
    pub mem_mib: u64,
    pub core_pct: u32,
    /// The whole GPU, nobody else on it.
    pub exclusive: bool,
}

/// `NVIDIA_VISIBLE_DEVICES` and `GPUPLACE_GPU_UUIDS` (the UUIDs), `GPUPLACE_GPU_INDICES` (the node's
/// indices), all in the order given, which the caller keeps in GPU index order.
pub fn gpu_env(gpus: &[(u32, &str)]) -> Vec<(String, String)> {
    let uuids = gpus.iter().map(|g| g.1).collect::<Vec<_>>().join(",");
    vec![
        ("NVIDIA_VISIBLE_DEVICES".into(), uuids.clone()),
        ("GPUPLACE_GPU_UUIDS".into(), uuids),
        ("GPUPLACE_GPU_INDICES".into(), gpus.iter().map(|g| g.0.to_string()).collect::<Vec<_>>().join(",")),
    ]
}

/// `GPUPLACE_GPU_MEM_MIB`, `GPUPLACE_GPU_CORE_PCT` (one value per GPU, in the order of
/// [`gpu_env`]), `GPUPLACE_EXCLUSIVE`, and for a share MPS's limits: `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`
/// by container ordinal, `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` (1-99) and, with `mps`,
/// `CUDA_MPS_PIPE_DIRECTORY` and `CUDA_VISIBLE_DEVICES` (`uuids`, the GPUs in [`gpu_env`]'s order:
/// the daemon serves all the node's GPUs, and this keeps the client to its own, numbered as the
/// limit's ordinals), with the pipe directory and the daemon's `/dev/shm` to mount. A whole GPU gets
/// none of MPS: it never connects to the daemon.
pub fn limit_env(
    limits: &[GpuLimit],
    uuids: &[&str],
    mps: Option<&MpsConnect>,
) -> (Vec<(String, String)>, Vec<HostMount>) {
    let join = |v: Vec<String>| v.join(",");
    let mut env = vec![
        ("GPUPLACE_GPU_MEM_MIB".to_string(), join(limits.iter().map(|l| l.mem_mib.to_string()).collect())),
        ("GPUPLACE_GPU_CORE_PCT".to_string(), join(limits.iter().map(|l| l.core_pct.to_string()).collect())),
    ];
    let exclusive = limits.iter().all(|l| l.exclusive);
    env.push(("GPUPLACE_EXCLUSIVE".into(), exclusive.to_string()));
    if exclusive {
        return (env, Vec::new());
    }
    let pinned = limits.iter().enumerate().map(|(i, l)| format!("{i}={}M", l.mem_mib)).collect();
    env.push(("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(), join(pinned)));
    // MPS takes one percentage for all devices; slices of one container are equal by contract, and
    // the smallest is the safe one if they ever differ
    let core = limits.iter().map(|l| l.core_pct).min().unwrap_or(0);
    if (1..100).contains(&core) {
        env.push(("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), core.to_string()));
    }
    let mut mounts = Vec::new();
    if let Some(m) = mps {
        let pipe = m.pipe_dir.display().to_string();
        env.push(("CUDA_MPS_PIPE_DIRECTORY".into(), pipe.clone()));
        env.push(("CUDA_VISIBLE_DEVICES".into(), uuids.join(",")));
        mounts.push(HostMount { host_path: pipe.clone(), container_path: pipe });
        if let Some(shm) = &m.shm_dir {
            mounts.push(HostMount { host_path: shm.display().to_string(), container_path: "/dev/shm".into() });
        }
    }
    (env, mounts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn get<'a>(env: &'a [(String, String)], k: &str) -> Option<&'a str> {
        env.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str())
    }

    #[test]
    fn whole_gpus_get_no_mps_limits_and_shares_do() {
        let ids = gpu_env(&[(2, "GPU-a"), (5, "GPU-b")]);
        assert_eq!(get(&ids, "NVIDIA_VISIBLE_DEVICES"), Some("GPU-a,GPU-b"));
        assert_eq!(get(&ids, "GPUPLACE_GPU_INDICES"), Some("2,5"));

        let whole = [GpuLimit { mem_mib: 81559, core_pct: 100, exclusive: true }; 2];
        let mps = MpsConnect { pipe_dir: "/run/mps/pipe".into(), shm_dir: Some("/run/mps/shm".into()) };
        let (env, mounts) = limit_env(&whole, &["GPU-a", "GPU-b"], Some(&mps));
        assert_eq!(get(&env, "GPUPLACE_EXCLUSIVE"), Some("true"));
        assert_eq!(get(&env, "GPUPLACE_GPU_MEM_MIB"), Some("81559,81559"));
        assert!(get(&env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT").is_none() && mounts.is_empty());
        assert!(env.iter().all(|(k, _)| !k.starts_with("CUDA_")), "whole GPUs stay off MPS");

        let share = [GpuLimit { mem_mib: 20000, core_pct: 25, exclusive: false }];
        let (env, mounts) = limit_env(&share, &["GPU-a"], Some(&mps));
        assert_eq!(get(&env, "GPUPLACE_EXCLUSIVE"), Some("false"));
        assert_eq!(get(&env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), Some("0=20000M"));
        assert_eq!(get(&env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), Some("25"));
        assert_eq!(get(&env, "CUDA_MPS_PIPE_DIRECTORY"), Some("/run/mps/pipe"));
        assert_eq!(get(&env, "CUDA_VISIBLE_DEVICES"), Some("GPU-a"));
        assert_eq!(
            mounts,
            [
                HostMount { host_path: "/run/mps/pipe".into(), container_path: "/run/mps/pipe".into() },
                HostMount { host_path: "/run/mps/shm".into(), container_path: "/dev/shm".into() },
            ]
        );
        // a two-GPU share: one limit per container ordinal, the ordinals its own GPUs in order
        let (env, _) = limit_env(
            &[share[0], GpuLimit { mem_mib: 20000, core_pct: 25, exclusive: false }],
            &["GPU-a", "GPU-b"],
            Some(&mps),
        );
        assert_eq!(get(&env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), Some("0=20000M,1=20000M"));
        assert_eq!(get(&env, "CUDA_VISIBLE_DEVICES"), Some("GPU-a,GPU-b"));
        // memory alone: no compute percentage; no daemon: no pipe, no mounts
        let (env, mounts) = limit_env(&[GpuLimit { mem_mib: 1024, core_pct: 0, exclusive: false }], &["GPU-a"], None);
        assert!(
            get(&env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE").is_none() && get(&env, "CUDA_MPS_PIPE_DIRECTORY").is_none()
        );
        assert!(mounts.is_empty() && get(&env, "CUDA_VISIBLE_DEVICES").is_none());
    }
}
