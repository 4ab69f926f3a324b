//! Tests of [`super`] (tools.rs).

use super::*;

/// Qwen2.5's native call as its tokens decode (`<tool_call>` and `</tool_call>`
/// are one token each); the response formatters' tests (`openai.rs`) use it too.
pub(crate) const QWEN_CALL: [&str; 19] = [
    "<tool_call>",
    "\n",
    "{\"",
    "name",
    "\":",
    " \"",
    "get",
    "_weather",
    "\",",
    " \"",
    "arguments",
    "\":",
    " {\"",
    "city",
    "\":",
    " \"",
    "Paris",
    "\"}}\n",
    "</tool_call>",
];

fn obj(v: Value) -> Map<String, Value> {
    v.as_object().unwrap().clone()
}

fn weather() -> Value {
    json!({"type": "function", "function": {"name": "get_weather", "description": "Weather now",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}})
}

#[test]
fn parses_both_shapes_and_refuses_bad_lists_naming_the_field() {
    let t = parse(&obj(json!({"tools": [weather()]})), true)
        .unwrap()
        .unwrap();
    assert_eq!(t.choice, ToolChoice::Auto);
    assert_eq!(t.tools[0].name, "get_weather");
    // Workers AI: the function object itself.
    let bare = json!({"tools": [{"name": "sum", "description": "adds",
                                  "parameters": {"type": "object"}}]});
    assert_eq!(
        parse(&obj(bare.clone()), false).unwrap().unwrap().tools[0].name,
        "sum"
    );
    assert_eq!(
        parse(&obj(bare), true).unwrap_err().param.as_deref(),
        Some("tools")
    );
    // none, or no tools: plain text.
    assert!(parse(
        &obj(json!({"tools": [weather()], "tool_choice": "none"})),
        true
    )
    .unwrap()
    .is_none());
    assert!(parse(&obj(json!({"tool_choice": "auto"})), true)
        .unwrap()
        .is_none());
    let named = json!({"tools": [weather()],
                       "tool_choice": {"type": "function", "function": {"name": "get_weather"}}});
    assert_eq!(
        parse(&obj(named), true).unwrap().unwrap().choice,
        ToolChoice::Named("get_weather".into())
    );
    for (body, param) in [
        (json!({"tools": {}}), "tools"),
        (json!({"tools": [1]}), "tools"),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a b"}}]}),
            "tools",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": ""}}]}),
            "tools",
        ),
        (
            json!({"tools": [{"type": "other", "function": {"name": "a"}}]}),
            "tools",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "a", "parameters": []}}]}),
            "tools",
        ),
        (json!({"tools": [weather(), weather()]}), "tools"),
        (json!({"tools": vec![weather(); MAX_TOOLS + 1]}), "tools"),
        (
            json!({"tools": [weather()], "tool_choice": "always"}),
            "tool_choice",
        ),
        (
            json!({"tools": [weather()], "tool_choice": 3}),
            "tool_choice",
        ),
        (json!({"tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": [weather()], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice",
        ),
        (
            json!({"tools": [weather()], "parallel_tool_calls": "yes"}),
            "parallel_tool_calls",
        ),
    ] {
        let e = parse(&obj(body.clone()), true).unwrap_err();
        assert_eq!(e.param.as_deref(), Some(param), "{body}: {}", e.message);
    }
}

#[test]
fn tools_are_shown_in_the_system_message_and_enforced_only_when_required() {
    let t = parse(&obj(json!({"tools": [weather()]})), true)
        .unwrap()
        .unwrap();
    let m = t.show(vec![ChatMessage::new("user", "hi")]);
    assert_eq!(m.len(), 2);
    assert_eq!(m[0].role, "system");
    assert!(
        m[0].content.contains("\"name\":\"get_weather\""),
        "{}",
        m[0].content
    );
    let m = t.show(vec![
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "hi"),
    ]);
    assert_eq!(m.len(), 2);
    assert!(
        m[0].content.starts_with("Be brief.\n\n<") || m[0].content.starts_with("Be brief.\n\nYou")
    );
    assert!(t.format().is_none());
    let r = parse(
        &obj(json!({"tools": [weather()], "tool_choice": "required"})),
        true,
    )
    .unwrap()
    .unwrap();
    let Some(ResponseFormat::JsonSchema { schema }) = r.format() else {
        panic!("required has a schema")
    };
    assert_eq!(schema["properties"]["name"]["const"], "get_weather");
    assert_eq!(schema["properties"]["arguments"]["required"][0], "city");
}

#[test]
fn history_renders_calls_and_responses() {
    let m = json!({"role": "assistant", "content": null, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]});
    let s = history_text(1, "assistant", None, &m).unwrap();
    // As Qwen2.5's template writes a call (Python's JSON separators).
    assert_eq!(s, "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>");
    let s = history_text(2, "tool", Some("12 C".into()), &json!({"role": "tool"})).unwrap();
    assert_eq!(s, "12 C");
    let wrapped = tool_responses_as_text(vec![
        ChatMessage::new("user", "x"),
        ChatMessage::new("tool", "12 C"),
    ]);
    assert_eq!(wrapped[0].content, "x");
    assert_eq!(
        wrapped[1].content,
        "<tool_response>\n12 C\n</tool_response>"
    );
    for bad in [
        json!({"role": "assistant", "tool_calls": {}}),
        json!({"role": "assistant", "tool_calls": [{"function": {}}]}),
    ] {
        let e = history_text(0, "assistant", None, &bad).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages"));
    }
    let e = history_text(0, "user", Some("x".into()), &json!({"tool_calls": []})).unwrap_err();
    assert_eq!(e.param.as_deref(), Some("messages"));
    assert!(history_text(0, "user", None, &json!({})).is_err());
}

fn scan(t: &Tools, pieces: &[&str]) -> (String, Vec<ToolCall>) {
    let mut s = t.scanner();
    let mut shown: String = pieces.iter().map(|p| s.push(p)).collect();
    let (tail, calls) = s.finish();
    shown.push_str(&tail);
    (shown, calls)
}

#[test]
fn the_scanner_finds_calls_across_pieces_and_gives_back_everything_else() {
    let t = parse(&obj(json!({"tools": [weather()]})), true)
        .unwrap()
        .unwrap();
    // A call split at every boundary, with text around it.
    let out = "Let me check. <tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call> ok";
    for split in 0..out.len() {
        if !out.is_char_boundary(split) {
            continue;
        }
        let (text, calls) = scan(&t, &[&out[..split], &out[split..]]);
        assert_eq!(text, "Let me check.  ok", "split at {split}");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].arguments, json!({"city": "Oslo"}));
    }
    // Text is not held back longer than a possible tag start.
    let mut s = t.scanner();
    assert_eq!(s.push("a <tool"), "a ");
    assert_eq!(s.push("box>"), "<toolbox>");
    // Unclosed at the end, arguments as JSON text: still a call.
    let (text, calls) = scan(&t, &["<tool_call>{\"name\": \"get_weather\", \"arguments\": \"{\\\"city\\\": \\\"Rome\\\"}\"}"]);
    assert_eq!(
        (text.as_str(), calls[0].arguments.clone()),
        ("", json!({"city": "Rome"}))
    );
    // Unknown function, bad JSON, arguments not an object: text.
    for body in [
        "<tool_call>{\"name\": \"rm\", \"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\": \"get_weather\", </tool_call>",
        "<tool_call>{\"name\": \"get_weather\", \"arguments\": 3}</tool_call>",
        "<tool_call>{\"name\": \"get_weather\"",
    ] {
        let (text, calls) = scan(&t, &[body]);
        assert!(calls.is_empty(), "{body}");
        assert_eq!(text, body);
    }
    // Required: the whole output is the call.
    let r = Tools {
        choice: ToolChoice::Required,
        ..t.clone()
    };
    let (text, calls) = scan(
        &r,
        &[
            "{\"name\": \"get_weather\", ",
            "\"arguments\": {\"city\": \"X\"}}",
        ],
    );
    assert_eq!((text.as_str(), calls.len()), ("", 1));
    let (text, calls) = scan(&r, &["{\"name\": \"get_weather\", \"argu"]);
    assert_eq!(
        (text.as_str(), calls.len()),
        ("{\"name\": \"get_weather\", \"argu", 0)
    );
}

/// Qwen2.5's native call, as its tokens arrive (`<tool_call>` and `</tool_call>`
/// are single tokens of its vocabulary), two in a row as it writes parallel
/// calls, then the end of its turn.
#[test]
fn qwens_native_calls_are_calls_token_by_token() {
    let two = json!({"tools": [weather(), {"type": "function", "function": {"name": "get_time",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]});
    let t = parse(&obj(two), true).unwrap().unwrap();
    let second = [
        "\n",
        "<tool_call>",
        "\n",
        "{\"name\": \"get_time\", \"arguments\": {\"city\": \"Paris\"}}",
        "\n",
        "</tool_call>",
    ];
    let pieces: Vec<&str> = QWEN_CALL.iter().chain(&second).copied().collect();
    let mut s = t.scanner();
    let shown: Vec<String> = pieces.iter().map(|p| s.push(p)).collect();
    let (tail, calls) = s.finish();
    // Nothing of the calls is shown; the newline between them is text.
    assert_eq!(shown.concat() + &tail, "\n");
    assert_eq!(
        calls,
        vec![
            ToolCall {
                name: "get_weather".into(),
                arguments: json!({"city": "Paris"})
            },
            ToolCall {
                name: "get_time".into(),
                arguments: json!({"city": "Paris"})
            },
        ]
    );
}

/// Qwen2.5-Coder 0.5B answers a tool question with the call's JSON alone, or in
/// a `json` code fence: calls, as llama.cpp's parser of the format takes them.
/// Any other output that starts so is held to the end and given back whole.
#[test]
fn an_output_of_bare_or_fenced_json_calls_is_calls() {
    let t = parse(&obj(json!({"tools": [weather()]})), true)
        .unwrap()
        .unwrap();
    let paris = ToolCall {
        name: "get_weather".into(),
        arguments: json!({"city": "Paris"}),
    };
    let bare = "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}";
    let fenced = "```json\n{\n  \"name\": \"get_weather\",\n  \"arguments\": {\n    \"city\": \"Paris\"\n  }\n}\n```";
    let unclosed = "```\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}";
    let twice = format!("{bare}\n{bare}");
    for (out, n) in [(bare, 1), (fenced, 1), (unclosed, 1), (twice.as_str(), 2)] {
        for split in (0..out.len()).filter(|&i| out.is_char_boundary(i)) {
            let mut s = t.scanner();
            // Nothing is shown while it may be a call.
            assert_eq!(s.push(&out[..split]), "", "{out:?} at {split}");
            assert_eq!(s.push(&out[split..]), "", "{out:?} at {split}");
            let (tail, calls) = s.finish();
            assert_eq!((tail.as_str(), calls.len()), ("", n), "{out:?} at {split}");
            assert_eq!(calls[0], paris);
        }
    }
    // Held, then given back whole: JSON that is not a call, a call followed by
    // text, an unknown function; a fence of Python streams as it comes.
    for out in [
        "{\"city\": \"Paris\"}",
        "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}} Done.",
        "{\"name\": \"rm\", \"arguments\": {}}",
        "```json\n[1, 2]\n```",
    ] {
        let (text, calls) = scan(&t, &[out]);
        assert_eq!((text.as_str(), calls.len()), (out, 0));
    }
    let mut s = t.scanner();
    assert_eq!(s.push("  ``"), "");
    assert_eq!(s.push("`python\nprint(1)"), "  ```python\nprint(1)");
    let mut s = t.scanner();
    assert_eq!(s.push("Sure: {\"a\": 1}"), "Sure: {\"a\": 1}");
    // A call in tags after leading JSON-looking text is still found at the end.
    let (text, calls) = scan(&t, &["{}\n<tool_call>", bare, "</tool_call>"]);
    assert_eq!((text.as_str(), calls.len()), ("{}\n", 1));
}

#[test]
fn call_shapes() {
    let calls = vec![ToolCall {
        name: "f".into(),
        arguments: json!({"a": 1}),
    }];
    let o = openai_calls("r1", &calls, false);
    assert_eq!(o[0]["id"], "call_r1_0");
    assert_eq!(o[0]["function"]["arguments"], "{\"a\":1}");
    assert!(o[0].get("index").is_none());
    assert_eq!(openai_calls("r1", &calls, true)[0]["index"], 0);
    assert_eq!(
        workers_ai_calls(&calls),
        json!([{"name": "f", "arguments": {"a": 1}}])
    );
}
