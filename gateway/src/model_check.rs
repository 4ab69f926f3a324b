//! Stage 2 of a request: a [`ParsedRequest`] checked against the model that serves
//! it, giving a [`ValidRequest`] (model resolved, chat rendered, prompt
//! tokenized, I1 checked against the model's limits, output options bounded).
//! Later phases accept only a [`ValidRequest`], so nothing unchecked reaches the
//! engine. Pure: nothing is allocated, nothing reaches the engine here.

use crate::catalog::CatalogEntry;
use crate::error::{ApiError, ErrorKind};
use crate::tools::{self, Tools};
use crate::validation::{Input, ParsedRequest};
use tessera_model::chat::{ChatError, ChatMessage};
use tessera_model::sampling::{prompt_logprobs_wire_bytes, MAX_PROMPT_LOGPROBS_BYTES};
use tessera_model::tokenizer::TokenizerError;
use tessera_model::LoadedModel;
use tessera_serving::admission::{
    Admitted, GenerateRequest, OutputOptions, PdAdmission, Rejection,
};
use tessera_serving::Priority;

/// What validation takes from the caller's tenant record: server-side values only,
/// never anything from the request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TenantContext {
    /// The id the engine tags KV pages with.
    pub engine_id: u64,
    /// Fair-share weight (>= 1).
    pub weight: u32,
    /// Highest class the tenant's requests may run in.
    pub max_priority: Priority,
    /// The tenant's prefix-cache namespace (derived from the account and its salt).
    pub cache_namespace: Option<[u8; 32]>,
    /// The tenant's own bounds on its cached pages (from its record).
    pub cache_policy: tessera_serving::CachePolicy,
    /// The fine-tune the request's `lora` names, resolved and loaded for this tenant
    /// (`None`: none was resolved; a request naming one is then refused).
    pub lora: Option<tessera_serving::LoraRef>,
}

impl TenantContext {
    /// A tenant of engine id `engine_id` with weight 1, interactive allowed and no
    /// prefix cache.
    pub fn plain(engine_id: u64) -> Self {
        Self {
            engine_id,
            weight: 1,
            max_priority: Priority::Interactive,
            cache_namespace: None,
            cache_policy: Default::default(),
            lora: None,
        }
    }
}

/// A request ready for the engine: I1 checked against the model's limits.
#[derive(Clone, Debug)]
pub struct ValidRequest {
    /// Catalog entry.
    pub model: CatalogEntry,
    /// The engine request (token ids), admitted (I1) against the engines'
    /// [`PdAdmission`]: the proof `EngineHandle::submit` takes.
    pub request: Admitted,
    /// Stream as server-sent events.
    pub stream: bool,
    /// OpenAI `stream_options.include_usage`.
    pub include_usage: bool,
    /// Completions `echo`: the prompt text to send back before the completion.
    pub echo: Option<String>,
    /// The request's tools: its output is scanned for calls.
    pub tools: Option<Tools>,
    /// The fine-tune it runs under, as the caller named it (`lora`, or after the
    /// `:` of `model`): OpenAI answers name the model `<model>:<fine-tune>`.
    pub finetune: Option<String>,
}

/// The 404 for a model id the catalog does not have (Workers AI code 5007).
pub fn no_such_model(id: &str) -> ApiError {
    let mut e = ApiError::new(ErrorKind::NoSuchModel, format!("No such model {id}"));
    e.param = Some("model".into());
    e
}

/// Maps an engine admission rejection to the client error.
pub fn rejection(r: &Rejection) -> ApiError {
    match r {
        Rejection::ContextOverflow { .. } | Rejection::PoolTooSmall { .. } => {
            ApiError::new(ErrorKind::ContextOverflow, r.to_string())
        }
        Rejection::Sampling(e) => ApiError::field(e.field(), e.to_string()),
        Rejection::Stop(_) => ApiError::field("stop", r.to_string()),
        Rejection::ZeroMaxTokens => ApiError::field("max_tokens", r.to_string()),
        Rejection::EmptyPrompt => ApiError::field("prompt", r.to_string()),
        Rejection::Lora(_) => ApiError::field("lora", r.to_string()),
        Rejection::NoDraftModel => ApiError::field("speculative", r.to_string()),
        Rejection::BadToken { .. } => ApiError::new(ErrorKind::BadRequest, r.to_string()),
        Rejection::Unavailable(_) => {
            let mut e = ApiError::new(ErrorKind::Unavailable, r.to_string());
            e.retryable = true;
            e
        }
    }
}

/// Renders and tokenizes the input for the model `entry` (resolved by the caller,
/// once) and admits it (I1) against `admission`, the serving engines' limits
/// (`EngineHandle::admission`): pure, nothing is allocated, nothing reaches the
/// engine. The request runs in the class it asked for, or the tenant's ceiling if it asked for
/// none or for a higher one; weight and cache namespace come from `tenant` alone.
pub fn validate(
    p: ParsedRequest,
    entry: &CatalogEntry,
    model: &LoadedModel,
    admission: PdAdmission,
    tenant: &TenantContext,
) -> Result<ValidRequest, ApiError> {
    let entry = entry.clone();
    let finetune = p.lora.clone().filter(|_| tenant.lora.is_some());
    // Chat input: control tokens only where the template put them (message
    // contents are plain text, so they cannot open new turns). A raw prompt is the
    // caller's own template: its control-token text (`<|im_start|>`, ...) becomes the
    // control tokens, as llama.cpp's server and vLLM parse completions prompts.
    let tools = p.tools;
    // A fine-tune is resolved for the tenant before validation (requests, batch
    // items); one named but not resolved is refused, never run as the base.
    let lora = match (&p.lora, &tenant.lora) {
        (None, _) => None,
        (Some(_), Some(l)) => Some(l.clone()),
        (Some(_), None) => {
            return Err(ApiError::field(
                "lora",
                "`lora` names a fine-tune that was not resolved for this request",
            ))
        }
    };
    // The field the input came in, which a refusal of it names.
    let input_field = match &p.input {
        Input::Prompt { .. } => "prompt",
        Input::Messages(_) => "messages",
    };
    let context_param = |mut e: ApiError| {
        if e.kind == ErrorKind::ContextOverflow && e.param.is_none() {
            e.param = Some(input_field.into());
        }
        e
    };
    // Tokens the prompt may take: a long prompt known to be longer is refused
    // before it is tokenized to the end (a megabyte costs seconds of tokenizer
    // time); a short one is tokenized, so its refusal gives the exact count.
    let input_bytes = match &p.input {
        Input::Prompt { text, .. } => text.len(),
        Input::Messages(m) => m.iter().map(|m| m.content.len()).sum(),
    };
    let room = if input_bytes > EARLY_REFUSAL_BYTES {
        admission.limits.context.saturating_sub(p.max_tokens)
    } else {
        usize::MAX
    };
    if tools.is_some() && !model.chat.has_template() {
        return Err(ApiError::field(
            "tools",
            "`tools` cannot be shown to this model: it has no chat template (GGUF \
             `tokenizer.chat_template`; a base model); send a raw `prompt` without `tools`",
        ));
    }
    // A template that renders tools gets them (and `tool` turns as they are); any
    // other shows them in a system message of ours (and `tool` turns as text).
    let native = model.chat.supports_tools();
    let template_tools = tools.as_ref().filter(|_| native).map(Tools::template_json);
    let shown = |m: Vec<ChatMessage>| match &tools {
        _ if native => m,
        Some(t) => t.show(tools::tool_responses_as_text(m)),
        None => tools::tool_responses_as_text(m),
    };
    let chat = ChatInput {
        model,
        tools: template_tools.as_ref(),
        room,
        max_tokens: p.max_tokens,
        context: admission.limits.context,
        field: input_field,
    };
    let prompt = match &p.input {
        Input::Prompt { chat: false, .. } if tools.is_some() => {
            return Err(ApiError::field(
                "tools",
                "`tools` need a chat request: `messages`, or a `prompt` without `raw`",
            ))
        }
        // A raw prompt, or a `prompt` for a base model (no chat template): the text
        // as given, with the BOS/EOS the model's tokenizer adds (Gemma: BOS).
        Input::Prompt { text, chat } if !*chat || !model.chat.has_template() => {
            let cannot = |e: TokenizerError| {
                ApiError::field("prompt", format!("cannot tokenize the prompt: {e}"))
            };
            let tok = &model.tokenizer;
            let room = room.saturating_sub(tok.added_special_tokens());
            if let Some(at_least) = tok.exceeds(text, true, room).map_err(cannot)? {
                return Err(context_param(over_context(
                    at_least + tok.added_special_tokens(),
                    p.max_tokens,
                    admission.limits.context,
                )));
            }
            tok.encode_with_bos_eos(text, true).map_err(cannot)?
        }
        Input::Prompt { text, .. } => {
            chat.encode(&shown(vec![ChatMessage::new("user", text.clone())]))?
        }
        Input::Messages(m) => chat.encode(&shown(m.clone()))?,
    };
    if prompt.is_empty() {
        return Err(ApiError::field(
            "prompt",
            "prompt is empty after tokenization",
        ));
    }
    if prompt.len().saturating_add(p.max_tokens) > admission.limits.context {
        return Err(context_param(rejection(&Rejection::ContextOverflow {
            prompt: prompt.len(),
            max_tokens: p.max_tokens,
            context: admission.limits.context,
        })));
    }
    let priority = p
        .priority
        .unwrap_or(tenant.max_priority)
        .max(tenant.max_priority);
    let echo = match (&p.input, p.echo) {
        (Input::Prompt { text, .. }, true) => Some(text.clone()),
        _ => None,
    };
    // `required` or a named function: the call is the output's grammar.
    let (format, format_field) = match (tools.as_ref().and_then(Tools::format), p.format) {
        (Some(_), Some(_)) => {
            return Err(ApiError::field(
                "response_format",
                "`response_format` cannot be combined with `tool_choice` \"required\" or a \
                 named function: the output is then the call, shaped by the function's \
                 `parameters`",
            ))
        }
        (Some(f), None) => (Some(f), "tools"),
        (None, f) => (f, "response_format"),
    };
    if let Some(f) = &format {
        // Compiled here so a schema that cannot be enforced is a 400 before anything
        // is queued; the engine compiles its own copy.
        model
            .tokenizer
            .grammar()
            .and_then(|g| g.compile(f))
            .map_err(|e| ApiError::field(format_field, format!("`{format_field}`: {e}")))?;
    }
    let output = OutputOptions {
        logprobs: p.logprobs,
        prompt_logprobs: p.logprobs.filter(|_| echo.is_some()),
        format,
    };
    if let Some(k) = output.prompt_logprobs {
        // One entry per prompt position after the first, in one control frame.
        let positions = prompt.len().saturating_sub(1);
        if prompt_logprobs_wire_bytes(positions, k as usize) > MAX_PROMPT_LOGPROBS_BYTES {
            return Err(ApiError::field(
                "logprobs",
                format!(
                    "`echo` with `logprobs: {k}` is limited to {} prompt tokens; this prompt \
                     has {}. Ask for fewer alternatives or send a shorter prompt",
                    max_prompt_logprob_tokens(k as usize),
                    prompt.len()
                ),
            ));
        }
    }
    let request = GenerateRequest {
        tenant: tenant.engine_id,
        priority,
        weight: tenant.weight.max(1),
        cache_namespace: tenant.cache_namespace,
        cache_policy: tenant.cache_policy,
        prompt,
        max_tokens: p.max_tokens,
        sampling: p.sampling,
        stop: p.stop,
        ignore_eos: false,
        output,
        resume: None,
        speculate: p.speculative.map(|s| s.k),
        speculate_mode: p.speculative.and_then(|s| s.mode),
        lora,
    };
    let request = admission
        .admit(request)
        .map_err(|r| context_param(rejection(&r)))?;
    Ok(ValidRequest {
        model: entry,
        request,
        stream: p.stream,
        include_usage: p.include_usage,
        echo,
        tools,
        finetune,
    })
}

/// The longest prompt (tokens) whose `echo` log probabilities with `top`
/// alternatives fit [`MAX_PROMPT_LOGPROBS_BYTES`].
fn max_prompt_logprob_tokens(top: usize) -> usize {
    MAX_PROMPT_LOGPROBS_BYTES / prompt_logprobs_wire_bytes(1, top) + 1
}

/// What rendering and tokenizing a chat takes besides its messages.
struct ChatInput<'a> {
    model: &'a LoadedModel,
    /// Tools for a template that renders them.
    tools: Option<&'a serde_json::Value>,
    /// Stop tokenizing once the prompt is known to exceed this many tokens.
    room: usize,
    /// For the context refusal's message.
    max_tokens: usize,
    /// For the context refusal's message.
    context: usize,
    /// The request field the messages came in (`messages`, or `prompt` wrapped as
    /// a user message), which refusals of them name.
    field: &'static str,
}

impl ChatInput<'_> {
    /// Renders and tokenizes `messages`, stopping early when the prompt is known
    /// to exceed `room` tokens.
    ///
    /// Errors: 400 naming the input field (no chat template, the template refused
    /// the conversation, nothing to tokenize), or the context refusal; 400 without
    /// a field when the model's template itself does not parse.
    fn encode(&self, messages: &[ChatMessage]) -> Result<Vec<u32>, ApiError> {
        let m = self.model;
        m.chat
            .encode_with_tools(&m.tokenizer, messages, self.tools, true, self.room)
            .map_err(|e| match e {
                ChatError::OverLimit { at_least, .. } => {
                    let mut e = over_context(at_least, self.max_tokens, self.context);
                    e.param = Some(self.field.into());
                    e
                }
                e @ ChatError::Syntax(_) => ApiError::new(ErrorKind::BadRequest, e.to_string()),
                e => ApiError::field(self.field, e.to_string()),
            })
    }
}

/// Prompts longer than this (bytes of text) are checked against the context window
/// before tokenizing ([`Tokenizer::min_tokens`](tessera_model::tokenizer::Tokenizer::min_tokens));
/// shorter ones tokenize in milliseconds.
const EARLY_REFUSAL_BYTES: usize = 64 << 10;

/// The context-window refusal of a prompt known to be at least `at_least` tokens
/// (the early check: it was not tokenized to the end).
fn over_context(at_least: usize, max_tokens: usize, context: usize) -> ApiError {
    ApiError::new(
        ErrorKind::ContextOverflow,
        format!(
            "prompt (at least {at_least} tokens) + max_tokens ({max_tokens}) exceeds the \
             model's context window of {context} tokens"
        ),
    )
}
