//! `tessera generate`: one request through the co-located engine on this machine.

use crate::model_fetch;
use anyhow::{bail, Context, Result};
use clap::Args;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;
use tessera_engine::{Engine, EngineConfig, Event, GenerateRequest};
use tessera_model::chat::ChatMessage;
use tessera_model::sampling::SamplingParams;
use tessera_model::LoadedModel;

/// Arguments of `tessera generate`.
#[derive(Args, Debug)]
pub(crate) struct GenerateArgs {
    /// Prompt text.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user message in the model's chat template (its text
    /// then stays plain text, as a chat message's content does at the server).
    #[arg(long)]
    chat: bool,
    /// Tokenize control-token text in the prompt (`<|im_start|>`, ...) as plain
    /// text. Without it a prompt without `--chat` is read as the server reads a raw
    /// prompt (`raw: true`, `/v1/completions`) and as llama.cpp's CLI does: that
    /// text becomes the control tokens.
    #[arg(long)]
    no_parse_special: bool,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Print token ids and timings as JSON instead of streaming text.
    #[arg(long)]
    json: bool,
    /// GGUF model file (default: the fetched default model).
    #[arg(long, env = "TESSERA_MODEL")]
    model: Option<PathBuf>,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    /// Keep only the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: u32,
    /// Seed for sampling (same seed, same output).
    #[arg(long)]
    seed: Option<u64>,
    /// Repetition penalty (1 = off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Frequency penalty.
    #[arg(long, default_value_t = 0.0)]
    frequency_penalty: f32,
    /// Presence penalty.
    #[arg(long, default_value_t = 0.0)]
    presence_penalty: f32,
    /// Stop string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    ignore_eos: bool,
    /// KV pool size in tokens.
    #[arg(long, default_value_t = EngineConfig::default().kv_pool_tokens)]
    kv_pool_tokens: usize,
}

/// Resolves `--model`, falling back to the fetched default model.
pub(crate) fn model_path(arg: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(p) = arg {
        return Ok(p);
    }
    let p = model_fetch::default_model_path(&model_fetch::default_models_dir());
    if !p.exists() {
        bail!(
            "default model not found at {}: run `tessera model fetch` first or pass --model PATH",
            p.display()
        );
    }
    Ok(p)
}

pub(crate) fn run(a: GenerateArgs) -> Result<()> {
    let path = model_path(a.model)?;
    let t_load = Instant::now();
    let m = LoadedModel::load(&path).with_context(|| format!("loading {}", path.display()))?;
    let load_ms = t_load.elapsed().as_secs_f64() * 1e3;
    let prompt = if a.chat {
        m.chat.encode(
            &m.tokenizer,
            &[ChatMessage::new("user", a.prompt.clone())],
            true,
        )?
    } else {
        // As the server reads a raw prompt (gateway model_check): control-token
        // text becomes the control tokens, unless --no-parse-special.
        m.tokenizer
            .encode_with_bos_eos(&a.prompt, !a.no_parse_special)?
    };
    let mut engine = Engine::new(
        m.transformer.clone(),
        m.tokenizer.clone(),
        EngineConfig {
            kv_pool_tokens: a.kv_pool_tokens,
            ..EngineConfig::default()
        },
    );
    let req = GenerateRequest {
        sampling: SamplingParams {
            temperature: a.temperature,
            top_p: a.top_p,
            top_k: a.top_k,
            seed: a.seed,
            repetition_penalty: a.repetition_penalty,
            frequency_penalty: a.frequency_penalty,
            presence_penalty: a.presence_penalty,
        },
        stop: a.stop,
        ignore_eos: a.ignore_eos,
        ..GenerateRequest::new(0, prompt.clone(), a.max_tokens)
    };
    let admitted = engine.admit(req)?;
    let mut rx = engine.enqueue(admitted);
    let mut ids = Vec::new();
    let mut out = String::new();
    let stdout = std::io::stdout();
    while engine.has_work() {
        engine.step();
        while let Ok(ev) = rx.try_recv() {
            match ev {
                Event::Token { id, text, .. } => {
                    ids.push(id);
                    out.push_str(&text);
                    if !a.json {
                        let mut lock = stdout.lock();
                        write!(lock, "{text}")?;
                        lock.flush()?;
                    }
                }
                Event::Done { reason, usage } => {
                    if a.json {
                        let v = serde_json::json!({
                            "model": path.display().to_string(),
                            "prompt_ids": prompt,
                            "output_ids": ids,
                            "text": out,
                            "finish_reason": format!("{reason:?}").to_lowercase(),
                            "prompt_tokens": usage.prompt_tokens,
                            "completion_tokens": usage.completion_tokens,
                            "load_ms": load_ms,
                            "ttft_ms": usage.ttft.as_secs_f64() * 1e3,
                            "tpot_ms": usage.tpot.as_secs_f64() * 1e3,
                        });
                        println!("{}", serde_json::to_string_pretty(&v)?);
                    } else {
                        println!();
                        eprintln!(
                            "[{} prompt tokens, {} generated, TTFT {:.1} ms, TPOT {:.2} ms, finish: {:?}]",
                            usage.prompt_tokens,
                            usage.completion_tokens,
                            usage.ttft.as_secs_f64() * 1e3,
                            usage.tpot.as_secs_f64() * 1e3,
                            reason
                        );
                    }
                }
                Event::Error(e) => bail!("generation failed: {e}"),
            }
        }
    }
    Ok(())
}
