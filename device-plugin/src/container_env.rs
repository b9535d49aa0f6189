//! What a container is told about its GPUs: the environment of gpuplace's contract
//! (docs/device-plugin.md, "Allocate and pod identity"), the same whether the GPUs came from the
//! device plugin's Allocate or from a DRA claim's NodePrepareResources (pure).

use std::path::Path;

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
/// by container ordinal, `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE` (1-99) and, with `mps_pipe_dir`,
/// `CUDA_MPS_PIPE_DIRECTORY`. Also the pipe directory to mount into the container, for a share.
pub fn limit_env(limits: &[GpuLimit], mps_pipe_dir: Option<&Path>) -> (Vec<(String, String)>, Option<String>) {
    let join = |v: Vec<String>| v.join(",");
    let mut env = vec![
        ("GPUPLACE_GPU_MEM_MIB".to_string(), join(limits.iter().map(|l| l.mem_mib.to_string()).collect())),
        ("GPUPLACE_GPU_CORE_PCT".to_string(), join(limits.iter().map(|l| l.core_pct.to_string()).collect())),
    ];
    let exclusive = limits.iter().all(|l| l.exclusive);
    env.push(("GPUPLACE_EXCLUSIVE".into(), exclusive.to_string()));
    if exclusive {
        return (env, None);
    }
    let pinned = limits.iter().enumerate().map(|(i, l)| format!("{i}={}M", l.mem_mib)).collect();
    env.push(("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT".into(), join(pinned)));
    // MPS takes one percentage for all devices; slices of one container are equal by contract, and
    // the smallest is the safe one if they ever differ
    let core = limits.iter().map(|l| l.core_pct).min().unwrap_or(0);
    if (1..100).contains(&core) {
        env.push(("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE".into(), core.to_string()));
    }
    let dir = mps_pipe_dir.map(|d| d.display().to_string());
    if let Some(d) = &dir {
        env.push(("CUDA_MPS_PIPE_DIRECTORY".into(), d.clone()));
    }
    (env, dir)
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
        let (env, mount) = limit_env(&whole, Some(Path::new("/run/mps")));
        assert_eq!(get(&env, "GPUPLACE_EXCLUSIVE"), Some("true"));
        assert_eq!(get(&env, "GPUPLACE_GPU_MEM_MIB"), Some("81559,81559"));
        assert!(get(&env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT").is_none() && mount.is_none());

        let share = [GpuLimit { mem_mib: 20000, core_pct: 25, exclusive: false }];
        let (env, mount) = limit_env(&share, Some(Path::new("/run/mps")));
        assert_eq!(get(&env, "GPUPLACE_EXCLUSIVE"), Some("false"));
        assert_eq!(get(&env, "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"), Some("0=20000M"));
        assert_eq!(get(&env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"), Some("25"));
        assert_eq!((get(&env, "CUDA_MPS_PIPE_DIRECTORY"), mount.as_deref()), (Some("/run/mps"), Some("/run/mps")));
        // memory alone: no compute percentage
        let (env, _) = limit_env(&[GpuLimit { mem_mib: 1024, core_pct: 0, exclusive: false }], None);
        assert!(
            get(&env, "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE").is_none() && get(&env, "CUDA_MPS_PIPE_DIRECTORY").is_none()
        );
    }
}
