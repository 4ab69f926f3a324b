//! `--device cpu|cuda` of `tessera serve` and `tessera node` (issue 16).
//!
//! With `cuda` the node opens the GPU before anything else (the driver, NVRTC and
//! cuBLAS are probed first, so a machine without them gets an error naming what is
//! missing, never a panic), loads the model's weights onto it, sizes the KV pool
//! from the device memory then free and `--kv-memory-fraction`, and checks I2
//! against that pool's token count, per engine. A binary built without the cargo
//! feature `cuda` says so. The engines themselves do not run on the device yet:
//! after those checks the command stops with an error saying so (the device
//! forward pass is `tessera_model::cuda::CudaLlama`, exercised by
//! `scripts/gpu_check.sh`).

use anyhow::Result;
use clap::{Args, ValueEnum};
use std::path::Path;
use tessera_config::NodeRole;

/// `--device`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub(crate) enum Device {
    /// The CPU kernels (the default).
    Cpu,
    /// An NVIDIA GPU through CUDA.
    Cuda,
}

/// Where the engines compute.
#[derive(Args, Clone, Debug)]
pub(crate) struct DeviceArgs {
    /// Where the engines compute: `cpu`, or `cuda` (an NVIDIA GPU: needs a binary
    /// built with `--features cuda` and, at run time, the driver, NVRTC and cuBLAS).
    #[arg(long, value_enum, default_value = "cpu")]
    pub(crate) device: Device,
    /// With --device cuda: the share of the device memory left free by the weights
    /// that the KV pools take, split evenly between this process's engines; I2
    /// checks each engine's resulting token count.
    #[arg(long, default_value_t = 0.9)]
    pub(crate) kv_memory_fraction: f64,
    /// With --device cuda: the CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub(crate) cuda_device: usize,
}

impl DeviceArgs {
    /// Nothing for `--device cpu`. For `--device cuda`: opens the device, loads
    /// `model` onto it, sizes the pools and checks I2 for each `(role, pool name)`
    /// engine this process would run, then fails: the engines do not run on the
    /// device yet. Every failure names its cause (no CUDA in this build, a missing
    /// library, too little memory, a pool under one context window).
    pub(crate) fn prepare(
        &self,
        model_id: &str,
        model: &Path,
        engines: &[(NodeRole, &str)],
    ) -> Result<()> {
        match self.device {
            Device::Cpu => Ok(()),
            Device::Cuda => cuda(self, model_id, model, engines),
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &DeviceArgs, _: &str, _: &Path, _: &[(NodeRole, &str)]) -> Result<()> {
    anyhow::bail!(
        "--device cuda: this tessera binary was built without CUDA support; rebuild it with \
         `cargo build --release --features cuda` (no CUDA toolkit is needed to build: the \
         driver, NVRTC and cuBLAS are loaded at run time), or use --device cpu"
    )
}

#[cfg(feature = "cuda")]
fn cuda(a: &DeviceArgs, model_id: &str, model: &Path, engines: &[(NodeRole, &str)]) -> Result<()> {
    use tessera_kernels::cuda::{pool_pages, CudaDevice};
    use tessera_model::cuda::{CudaLlama, CudaOptions, PoolSize};
    let err = |e: &dyn std::fmt::Display| anyhow::anyhow!("--device cuda: {e}");
    let dev = CudaDevice::open(a.cuda_device).map_err(|e| err(&e))?;
    // The weights and step buffers first (with a one-page pool), then each
    // engine's share of the memory they leave free.
    let opts = CudaOptions {
        pool: PoolSize::Pages(1),
        ..CudaOptions::default()
    };
    let gpu = CudaLlama::load_file(model, dev, opts).map_err(|e| err(&e))?;
    let layout = gpu.config().kv_layout(opts.page_size);
    let free = gpu.device().mem_info().map_err(|e| err(&e))?.0;
    let share = a.kv_memory_fraction / engines.len().max(1) as f64;
    let pages = pool_pages(free, share, &layout).map_err(|e| err(&e))?;
    let (tokens, context) = (pages * layout.page_size, gpu.config().context);
    for &(role, name) in engines {
        tessera_config::check_pool_fits(model_id, context, role, name, tokens)
            .map_err(|e| anyhow::anyhow!("refusing to start: {e}"))?;
    }
    anyhow::bail!(
        "--device cuda: {} ({}) would hold {tokens} KV tokens per engine ({pages} pages; I2 \
         holds for a {context}-token context), but the engines do not run on the device yet \
         (issue 16); scripts/gpu_check.sh runs the device forward pass",
        gpu.device().info().name,
        gpu.device().info().arch,
    )
}
