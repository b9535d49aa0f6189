//! The device's memory as NVML reports it (what the device plugin advertises and what `nvidia-smi`
//! shows), readable with no CUDA context: the "before" of `context-overhead`. libnvidia-ml.so.1 is
//! loaded at run time; when it is missing, the readings are simply absent from the output.

use std::ffi::{c_char, c_uint, c_void, CString};

use libloading::{Library, Symbol};

#[repr(C)]
#[derive(Default)]
struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

type NvmlDevice = *mut c_void;

pub struct Nvml {
    lib: Library,
    dev: NvmlDevice,
}

/// Free and total, in bytes.
pub struct Memory {
    pub free: u64,
    pub total: u64,
}

impl Nvml {
    /// NVML's handle for the GPU at `pci_bus_id` (CUDA's form, `0000:00:04.0`), or why not.
    pub fn open(pci_bus_id: &str) -> Result<Nvml, String> {
        let lib = unsafe { Library::new("libnvidia-ml.so.1") }.map_err(|e| format!("libnvidia-ml.so.1: {e}"))?;
        unsafe {
            let init: Symbol<unsafe extern "C" fn() -> c_uint> =
                lib.get(b"nvmlInit_v2\0").map_err(|e| format!("nvmlInit_v2: {e}"))?;
            let r = init();
            if r != 0 {
                return Err(format!("nvmlInit_v2 returned {r}"));
            }
            let by_bus: Symbol<unsafe extern "C" fn(*const c_char, *mut NvmlDevice) -> c_uint> = lib
                .get(b"nvmlDeviceGetHandleByPciBusId_v2\0")
                .map_err(|e| format!("nvmlDeviceGetHandleByPciBusId_v2: {e}"))?;
            let bus = CString::new(pci_bus_id).map_err(|e| e.to_string())?;
            let mut dev: NvmlDevice = std::ptr::null_mut();
            let r = by_bus(bus.as_ptr(), &mut dev);
            if r != 0 {
                return Err(format!("nvmlDeviceGetHandleByPciBusId_v2({pci_bus_id}) returned {r}"));
            }
            Ok(Nvml { lib, dev })
        }
    }

    pub fn memory(&self) -> Result<Memory, String> {
        unsafe {
            let get: Symbol<unsafe extern "C" fn(NvmlDevice, *mut NvmlMemory) -> c_uint> =
                self.lib.get(b"nvmlDeviceGetMemoryInfo\0").map_err(|e| format!("nvmlDeviceGetMemoryInfo: {e}"))?;
            let mut m = NvmlMemory::default();
            let r = get(self.dev, &mut m);
            if r != 0 {
                return Err(format!("nvmlDeviceGetMemoryInfo returned {r}"));
            }
            Ok(Memory { free: m.free, total: m.total })
        }
    }
}
