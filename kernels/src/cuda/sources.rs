//! The device kernels' CUDA C sources (`kernels/cuda/`), embedded in the binary and
//! compiled at run time by NVRTC for the device's architecture.

/// The header every source includes (`#include "tessera_common.cuh"`): the page tag,
/// pool geometry and step-table structs shared with [`super::abi`], bf16/f16
/// conversions and warp reductions.
pub const COMMON_HEADER: (&str, &str) = (
    "tessera_common.cuh",
    include_str!("../../cuda/tessera_common.cuh"),
);

/// One CUDA C source file and the kernels (`extern "C" __global__`) it defines.
#[derive(Clone, Copy, Debug)]
pub struct KernelSource {
    /// File name under `kernels/cuda/` (also the NVRTC program name).
    pub name: &'static str,
    /// The source text.
    pub text: &'static str,
    /// Kernel entry points the host launches, in the file's order.
    pub kernels: &'static [&'static str],
}

/// Every kernel source of the CUDA backend.
pub const SOURCES: &[KernelSource] = &[
    KernelSource {
        name: "attention.cu",
        text: include_str!("../../cuda/attention.cu"),
        kernels: &[
            "paged_attention",
            "kv_store",
            "write_tags",
            "verify_page_tags",
        ],
    },
    KernelSource {
        name: "checksum.cu",
        text: include_str!("../../cuda/checksum.cu"),
        kernels: &["page_crc32c"],
    },
    KernelSource {
        name: "ops.cu",
        text: include_str!("../../cuda/ops.cu"),
        kernels: &[
            "embed_rows",
            "rms_norm",
            "rope",
            "swiglu",
            "to_bf16",
            "argmax_rows",
        ],
    },
    KernelSource {
        name: "dequant.cu",
        text: include_str!("../../cuda/dequant.cu"),
        kernels: &["dequant_q4_0", "dequant_q4_1", "dequant_q8_0"],
    },
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_listed_kernel_is_defined_once_in_its_source_and_every_defined_one_is_listed() {
        for s in SOURCES {
            let defined: Vec<&str> = s
                .text
                .split("extern \"C\" __global__ void ")
                .skip(1)
                .map(|rest| rest.split('(').next().unwrap_or("").trim())
                .collect();
            assert_eq!(defined, s.kernels, "{}", s.name);
            assert!(
                s.text.contains("#include \"tessera_common.cuh\""),
                "{}",
                s.name
            );
        }
    }
}
