//! The CUDA backend (cargo feature `cuda`): device kernels compiled at run time by
//! NVRTC for the device's architecture (`sm_90` on an H200), cuBLAS GEMMs, and the
//! KV pool in device memory with a device tag array (DESIGN.md §5, §7).
//!
//! Nothing of CUDA is needed to build: `libcuda` (the driver), `libnvrtc` and
//! `libcublas` are loaded at run time. [`probe`] looks for each before any CUDA
//! call (cudarc panics when a library it calls into is missing), and
//! [`CudaDevice::open`] fails with a [`CudaError`] naming what is missing.
//!
//! - [`sources`]: the CUDA C sources (`kernels/cuda/*.cu`), embedded.
//! - [`nvrtc`]: NVRTC loaded by path or name; compiles the sources to PTX or CUBIN.
//! - [`abi`]: the structs passed by value to the kernels (`KvGeom`, `SeqTables`).
//! - [`device`]: [`CudaDevice`] (context, stream, cuBLAS, compiled kernels and their
//!   launches), [`DeviceKv`] (the device KV pool and tag array), [`StepTables`].
//! - [`sizing`]: the pool's size from free device memory and a memory fraction.
//! - [`crc_math`]: the host mirror of the device page checksum's arithmetic.

pub mod abi;
pub mod crc_math;
pub mod device;
pub mod nvrtc;
pub mod sizing;
pub mod sources;

/// cudarc's device buffer, the type the launches take.
pub use cudarc::driver::CudaSlice;
pub use device::{AttentionLaunch, CudaDevice, DeviceInfo, DeviceKv, StepRow, StepSeq, StepTables};
pub use nvrtc::{Nvrtc, NvrtcError};
pub use sizing::{pool_pages, SizingError};

/// Errors of the CUDA backend. Each names what is missing or which call failed.
#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// The driver library is not installed (no NVIDIA driver on this machine).
    #[error(
        "CUDA driver library not found (tried {tried}): this machine has no NVIDIA driver \
         or the library is not on the loader's path (LD_LIBRARY_PATH); use --device cpu, \
         or run on a machine with an NVIDIA GPU and driver"
    )]
    DriverMissing {
        /// The library names searched.
        tried: String,
    },
    /// NVRTC is missing or failed (see [`NvrtcError`]).
    #[error(transparent)]
    Nvrtc(#[from] NvrtcError),
    /// cuBLAS is not installed.
    #[error(
        "cuBLAS (libcublas.so.13 or .12) not found: install the CUDA toolkit's cuBLAS or the \
         PyPI wheel nvidia-cublas and put its lib directory on LD_LIBRARY_PATH"
    )]
    CublasMissing,
    /// The driver loaded but reports no such device.
    #[error("no CUDA device {ordinal}: the driver reports {count} device(s)")]
    NoDevice {
        /// Device asked for.
        ordinal: usize,
        /// Devices the driver sees.
        count: i32,
    },
    /// A driver call failed.
    #[error("CUDA driver call {call} failed: {source}")]
    Driver {
        /// What was being done.
        call: &'static str,
        /// The driver's error.
        source: cudarc::driver::DriverError,
    },
    /// A cuBLAS call failed.
    #[error("cuBLAS call {call} failed: {source}")]
    Cublas {
        /// What was being done.
        call: &'static str,
        /// cuBLAS's error.
        source: cudarc::cublas::result::CublasError,
    },
    /// A shape or size the kernels do not support, or buffers that do not match.
    #[error("CUDA backend: {0}")]
    Shape(String),
}

impl CudaError {
    /// A stable machine label for metrics and logs.
    pub fn label(&self) -> &'static str {
        match self {
            Self::DriverMissing { .. } => "driver_missing",
            Self::Nvrtc(NvrtcError::Missing { .. }) => "nvrtc_missing",
            Self::Nvrtc(_) => "nvrtc",
            Self::CublasMissing => "cublas_missing",
            Self::NoDevice { .. } => "no_device",
            Self::Driver { .. } => "driver",
            Self::Cublas { .. } => "cublas",
            Self::Shape(_) => "shape",
        }
    }
}

/// What [`probe`] found: the libraries a [`CudaDevice`] needs, all present.
#[derive(Debug)]
pub struct Probe {
    /// NVRTC, loaded (kept for compiling the kernels).
    pub nvrtc: Nvrtc,
}

/// Looks for the CUDA driver, NVRTC and cuBLAS, in that order, without creating a
/// context or calling into any of them (cudarc would panic on a missing library).
///
/// Errors: [`CudaError::DriverMissing`], [`CudaError::Nvrtc`] (with
/// [`NvrtcError::Missing`] listing what was tried), [`CudaError::CublasMissing`].
pub fn probe() -> Result<Probe, CudaError> {
    // SAFETY: only tries to open the library by its candidate names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        let tried = cudarc::get_lib_name_candidates("cuda")
            .into_iter()
            .filter(|n| n.starts_with("libcuda.so"))
            .collect::<Vec<_>>()
            .join(", ");
        return Err(CudaError::DriverMissing { tried });
    }
    let nvrtc = Nvrtc::load()?;
    // SAFETY: as above.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(CudaError::CublasMissing);
    }
    Ok(Probe { nvrtc })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_driver_open_fails_naming_libcuda_instead_of_panicking() {
        // SAFETY: only tries to open the library.
        if unsafe { cudarc::driver::sys::is_culib_present() } {
            eprintln!("skipped: this machine has a CUDA driver (the GPU tests cover it)");
            return;
        }
        let e = CudaDevice::open(0).unwrap_err();
        assert_eq!(e.label(), "driver_missing");
        let msg = e.to_string();
        assert!(msg.contains("libcuda.so"), "{msg}");
        assert!(msg.contains("--device cpu"), "{msg}");
        assert!(matches!(probe(), Err(CudaError::DriverMissing { .. })));
    }
}
