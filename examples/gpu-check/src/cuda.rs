//! The few CUDA driver API calls gpu-check makes, over cudarc's raw bindings (`cudarc::driver::sys`,
//! libcuda loaded at run time): each call's `CUresult` becomes a [`CuError`] naming the call and the
//! CUDA error (`CUDA_ERROR_OUT_OF_MEMORY`, ...), which is what the JSON lines report.

use std::ffi::{c_char, c_void, CStr, CString};
use std::fmt;

use cudarc::driver::sys::{self, CUcontext, CUdevice, CUdevice_attribute, CUdeviceptr, CUfunction, CUmodule, CUresult};

/// A failed driver call: which call, and CUDA's name and text for the error.
#[derive(Debug, Clone)]
pub struct CuError {
    pub call: &'static str,
    pub name: String,
    pub text: String,
}

impl CuError {
    pub fn is_out_of_memory(&self) -> bool {
        self.name == "CUDA_ERROR_OUT_OF_MEMORY"
    }
}

impl fmt::Display for CuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} failed: {} ({})", self.call, self.name, self.text)
    }
}

fn check(call: &'static str, r: CUresult) -> Result<(), CuError> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    // The bindings' variant names are CUDA's error names; the driver's own text beside it.
    let name = format!("{r:?}");
    let mut p: *const c_char = std::ptr::null();
    let text = if unsafe { sys::cuGetErrorString(r, &mut p) } == CUresult::CUDA_SUCCESS && !p.is_null() {
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    } else {
        String::new()
    };
    Err(CuError { call, name, text })
}

/// Why no GPU could be used at all (exit code 2).
#[derive(Debug)]
pub enum NoGpu {
    /// libcuda.so.1 (the NVIDIA driver's CUDA library) could not be loaded.
    NoLibcuda,
    /// libcuda loaded, but cuInit or the device lookup failed.
    Driver(CuError),
    /// The driver sees fewer devices than the ordinal asked for.
    NoDevice { ordinal: i32, count: i32 },
}

impl fmt::Display for NoGpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NoGpu::NoLibcuda => write!(
                f,
                "libcuda (libcuda.so.1, the NVIDIA driver's CUDA library) could not be loaded: no NVIDIA driver \
                 on this machine, or its library folder is not in the loader's path (LD_LIBRARY_PATH, ldconfig)"
            ),
            NoGpu::Driver(e) => write!(f, "the CUDA driver is loaded but unusable: {e}"),
            NoGpu::NoDevice { ordinal, count } => {
                write!(f, "no CUDA device {ordinal}: the driver sees {count} device(s)")
            }
        }
    }
}

/// Whether libcuda can be loaded, without panicking as cudarc's first call would.
pub fn libcuda_present() -> bool {
    unsafe { sys::is_culib_present() }
}

/// A device after cuInit, before any context (so nothing is allocated on it yet).
pub struct Device {
    pub dev: CUdevice,
}

/// Driver version as CUDA's integer (13000 = 13.0).
pub fn driver_version() -> Result<i32, CuError> {
    let mut v = 0;
    check("cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut v) })?;
    Ok(v)
}

impl Device {
    pub fn open(ordinal: i32) -> Result<Device, NoGpu> {
        if !libcuda_present() {
            return Err(NoGpu::NoLibcuda);
        }
        check("cuInit", unsafe { sys::cuInit(0) }).map_err(NoGpu::Driver)?;
        let mut count = 0;
        check("cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut count) }).map_err(NoGpu::Driver)?;
        if ordinal < 0 || ordinal >= count {
            return Err(NoGpu::NoDevice { ordinal, count });
        }
        let mut dev = 0;
        check("cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, ordinal) }).map_err(NoGpu::Driver)?;
        Ok(Device { dev })
    }

    pub fn name(&self) -> Result<String, CuError> {
        let mut buf = [0 as c_char; 256];
        check("cuDeviceGetName", unsafe { sys::cuDeviceGetName(buf.as_mut_ptr(), buf.len() as i32, self.dev) })?;
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
    }

    /// `0000:00:04.0`, as NVML takes it.
    pub fn pci_bus_id(&self) -> Result<String, CuError> {
        let mut buf = [0 as c_char; 64];
        check("cuDeviceGetPCIBusId", unsafe {
            sys::cuDeviceGetPCIBusId(buf.as_mut_ptr(), buf.len() as i32, self.dev)
        })?;
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }.to_string_lossy().into_owned())
    }

    pub fn sm_count(&self) -> Result<i32, CuError> {
        let mut n = 0;
        check("cuDeviceGetAttribute(MULTIPROCESSOR_COUNT)", unsafe {
            sys::cuDeviceGetAttribute(&mut n, CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, self.dev)
        })?;
        Ok(n)
    }

    /// The device's primary context, made current on this thread (under MPS, this is where the
    /// process becomes an MPS client and its limits apply).
    pub fn context(&self) -> Result<Context, CuError> {
        let mut ctx: CUcontext = std::ptr::null_mut();
        check("cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, self.dev) })?;
        check("cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })?;
        Ok(Context { _ctx: ctx })
    }
}

/// The current context; the process's exit releases it (and every allocation in it).
pub struct Context {
    _ctx: CUcontext,
}

/// Free and total device memory as this context sees it (under MPS with a pinned memory limit, the
/// limit's view), in bytes.
pub fn mem_info(_ctx: &Context) -> Result<(u64, u64), CuError> {
    let (mut free, mut total) = (0usize, 0usize);
    check("cuMemGetInfo", unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
    Ok((free as u64, total as u64))
}

/// One device allocation, freed on drop.
pub struct DeviceBuffer {
    pub ptr: CUdeviceptr,
    pub bytes: u64,
}

impl DeviceBuffer {
    pub fn alloc(_ctx: &Context, bytes: u64) -> Result<DeviceBuffer, CuError> {
        let mut ptr: CUdeviceptr = 0;
        check("cuMemAlloc", unsafe { sys::cuMemAlloc_v2(&mut ptr, bytes as usize) })?;
        Ok(DeviceBuffer { ptr, bytes })
    }

    /// Writes every byte (so the memory is really backed and used), and waits for it.
    pub fn touch(&self, value: u8) -> Result<(), CuError> {
        check("cuMemsetD8", unsafe { sys::cuMemsetD8_v2(self.ptr, value, self.bytes as usize) })?;
        synchronize()
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        unsafe {
            sys::cuMemFree_v2(self.ptr);
        }
    }
}

pub fn synchronize() -> Result<(), CuError> {
    check("cuCtxSynchronize", unsafe { sys::cuCtxSynchronize() })
}

/// A kernel loaded from PTX text (the driver JIT-compiles it for the device).
pub struct Kernel {
    _module: CUmodule,
    func: CUfunction,
}

impl Kernel {
    pub fn from_ptx(_ctx: &Context, ptx: &str, name: &str) -> Result<Kernel, CuError> {
        let image = CString::new(ptx).expect("PTX text has no NUL");
        let mut module: CUmodule = std::ptr::null_mut();
        check("cuModuleLoadData", unsafe { sys::cuModuleLoadData(&mut module, image.as_ptr() as *const c_void) })?;
        let cname = CString::new(name).expect("kernel name has no NUL");
        let mut func: CUfunction = std::ptr::null_mut();
        check("cuModuleGetFunction", unsafe { sys::cuModuleGetFunction(&mut func, module, cname.as_ptr()) })?;
        Ok(Kernel { _module: module, func })
    }

    /// Launches on the default stream with a 1-D grid; `params` point at each argument's value.
    pub fn launch(&self, blocks: u32, threads: u32, params: &mut [*mut c_void]) -> Result<(), CuError> {
        check("cuLaunchKernel", unsafe {
            sys::cuLaunchKernel(
                self.func,
                blocks,
                1,
                1,
                threads,
                1,
                1,
                0,
                std::ptr::null_mut(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }
}
