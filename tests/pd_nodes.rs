//! Prefill/decode disaggregation as real processes: a decode node, a prefill node
//! (`tessera node`) and a gateway (`tessera serve --config`) on free loopback ports.
//! Solo equality across deployment shapes, node deaths mid-stream and mid-prefill,
//! restarts, I2 at node start, client disconnects, and a pool-full probe that is
//! admitted only when every decode page is free (no leak after a failure).
//!
//! Every wait is bounded by a deadline; nothing asserts how fast anything runs.

mod common;

use common::*;
use serde_json::{json, Value};
use std::time::{Duration, Instant};
use tokio::process::Command;

/// (a) A greedy request through the nodes returns what the same request returns
/// from the in-process default (`tessera serve`, PD over the in-process transport):
/// text and token counts, non-streaming and streaming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn greedy_output_through_nodes_equals_in_process_serve() {
    let dep = Deployment::start().await;
    let body = greedy(48);
    let (status, remote) = dep.gateway.run(&body).await;
    assert_eq!(status, 200, "{remote}\n{}", dep.logs());
    let text = remote["result"]["response"].as_str().unwrap().to_string();
    assert!(!text.is_empty(), "{remote}");

    let mut s = dep.gateway.stream(&body).await;
    assert_eq!(s.status, 200);
    s.read_until(REQUEST, |e| e.contains(&Ev::Done)).await;
    assert!(s.has_done() && !s.has_error(), "{:?}", s.events);
    assert_eq!(s.text(), text, "streamed text differs from non-streamed");

    let local_dir = tempfile::tempdir().unwrap();
    let data = local_dir.path().join("data");
    let local = start_serve(&data, &local_dir.path().join("serve.log")).await;
    let (status, solo) = local.run(&body).await;
    assert_eq!(status, 200, "{solo}");
    assert_eq!(
        solo["result"], remote["result"],
        "in-process serve and nodes disagree"
    );
}

/// (b) The decode node dies (SIGKILL) mid-stream: the client gets an error event,
/// never `[DONE]`; a restarted decode node serves new requests.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn decode_node_killed_mid_stream_errors_then_restart_serves() {
    let mut dep = Deployment::start().await;
    let mut s = dep.gateway.stream(&endless(2000)).await;
    assert_eq!(s.status, 200);
    s.read_until(REQUEST, |e| {
        e.iter().filter(|e| matches!(e, Ev::Text(_))).count() >= 5
    })
    .await;
    assert!(
        s.tokens() >= 5 && !s.has_done(),
        "stream did not get going: {:?}\n{}",
        s.events,
        dep.logs()
    );
    dep.kill("decode").await;
    s.read_until(REQUEST, |e| {
        e.iter().any(|e| matches!(e, Ev::Error(_) | Ev::Done))
    })
    .await;
    assert!(
        !s.has_done(),
        "a stream cut by a dead decode node ended with [DONE]: {:?}",
        s.events.last()
    );
    assert!(
        s.has_error(),
        "no error event after the decode node died (ended: {}): {:?}\n{}",
        s.ended,
        &s.events[s.events.len().saturating_sub(3)..],
        dep.logs()
    );
    assert!(s.tokens() < 2000);

    // While it is down, requests fail (not hang, not 200).
    let (status, v) = dep.gateway.run(&greedy(8)).await;
    assert_ne!(
        status, 200,
        "a request succeeded with the decode node down: {v}"
    );

    dep.restart("decode").await;
    let v = dep.gateway.run_when_up(&greedy(8)).await;
    assert!(!v["result"]["response"].as_str().unwrap().is_empty(), "{v}");
    dep.pool_is_free().await;
}

/// (c) The prefill node dies mid-prefill: the client gets an error; after a restart
/// the decode pool has no leaked pages (the pool-full probe is admitted).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefill_node_killed_mid_prefill_errors_and_leaks_nothing() {
    let mut dep = Deployment::start().await;
    let mut s = dep.gateway.stream(&long_prompt(64)).await;
    // The stream's head comes before any token; give prefill a moment to start.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    dep.kill("prefill").await;
    s.read_until(REQUEST, |e| {
        e.iter().any(|e| matches!(e, Ev::Error(_) | Ev::Done))
    })
    .await;
    if s.status == 200 {
        assert!(!s.has_done(), "{:?}", s.events);
        assert!(
            s.has_error(),
            "no error event after the prefill node died (ended: {}): {:?}\n{}",
            s.ended,
            s.events,
            dep.logs()
        );
        assert_eq!(
            s.tokens(),
            0,
            "tokens before prefill finished: {:?}",
            s.events
        );
    } else {
        assert!(s.status >= 500, "status {}", s.status);
    }
    dep.restart("prefill").await;
    dep.pool_is_free().await;
}

/// (d) I2 at node start: a node whose pool is smaller than the model's context
/// window refuses to start, naming the model, the role and both numbers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_with_pool_below_context_refuses_to_start() {
    let dir = tempfile::tempdir().unwrap();
    for (role, pools) in [("decode", (CONTEXT, 4096)), ("prefill", (4100, CONTEXT))] {
        let (p, d) = (free_port(), free_port());
        let config = write_config(dir.path(), free_port(), p, &[d], pools);
        let port = if role == "decode" { d } else { p };
        let out = tokio::time::timeout(
            START,
            Command::new(BIN)
                .args(["node", "--role", role, "--config"])
                .arg(&config)
                .args(["--listen", &format!("127.0.0.1:{port}")])
                .kill_on_drop(true)
                .output(),
        )
        .await
        .expect("the node exits")
        .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{role} node started: {err}");
        // 4100 tokens are 256 whole pages of 16: 4096 usable.
        for needle in [MODEL_ID, role, "4096", "8192"] {
            assert!(err.contains(needle), "{role}: no `{needle}` in: {err}");
        }
        // It never listened.
        assert!(std::net::TcpStream::connect(("127.0.0.1", port)).is_err());
    }
}

/// (e) Clients that disconnect mid-stream (during prefill, after a few tokens, and
/// several at once) leave no pages behind on the nodes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_disconnects_through_nodes_leak_nothing() {
    let dep = Deployment::start().await;
    // One dropped during its (long) prefill, two dropped after a few tokens; their
    // reservations together hold most of the decode pool.
    let mut a = dep.gateway.stream(&endless(1500)).await;
    let mut b = dep.gateway.stream(&endless(1500)).await;
    for s in [&mut a, &mut b] {
        assert_eq!(s.status, 200);
        s.read_until(REQUEST, |e| {
            e.iter().filter(|e| matches!(e, Ev::Text(_))).count() >= 3
        })
        .await;
        assert!(
            s.tokens() >= 3 && !s.has_error(),
            "{:?}\n{}",
            s.events,
            dep.logs()
        );
    }
    let early = dep.gateway.stream(&long_prompt(1000)).await;
    assert_eq!(early.status, 200);
    tokio::time::sleep(Duration::from_millis(1000)).await;
    drop(early);
    drop(a);
    drop(b);
    dep.pool_is_free().await;
    // And the deployment still serves ordinary requests afterwards.
    let v = dep.gateway.run_when_up(&greedy(8)).await;
    assert!(!v["result"]["response"].as_str().unwrap().is_empty(), "{v}");
}

/// A second gateway in front of the same nodes (a restarted gateway, or a fleet of
/// gateways) gets its answers. Request ids must be unique across every coordinator
/// that talks to a node (the protocol's `ReqId`); each gateway numbering from 1 makes
/// the second gateway's first request collide with the first one's tombstone on the
/// nodes, and it hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_gateway_on_the_same_nodes_is_served() {
    let dep = Deployment::start().await;
    let (status, first) = dep.gateway.run(&greedy(8)).await;
    assert_eq!(status, 200, "{first}");
    let second =
        start_config_gateway(dep.dir.path(), &dep.config, "data2", "gateway2.log", &[]).await;
    let resp = reqwest::Client::new()
        .post(second.url())
        .bearer_auth(&second.key)
        .json(&greedy(8))
        .timeout(Duration::from_secs(30))
        .send()
        .await;
    let resp = resp.unwrap_or_else(|e| panic!("the second gateway's request hung: {e}"));
    assert_eq!(resp.status(), 200);
    let v: Value = resp.json().await.unwrap();
    assert_eq!(v["result"], first["result"], "{v}");
}

/// While every decode node is down the gateway is not ready (`/readyz` 503, so a
/// load balancer stops sending) and a request, streaming or not, is refused with
/// 503 before any byte of a stream (never a 200 that then fails); once the node is
/// back, both recover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_without_a_decode_node_is_unready_and_refuses_with_503() {
    let mut dep = Deployment::start().await;
    let readyz = |base: String| async move {
        reqwest::get(format!("{base}/readyz"))
            .await
            .map(|r| r.status().as_u16())
            .unwrap_or(0)
    };
    assert_eq!(readyz(dep.gateway.base.clone()).await, 200);
    dep.kill("decode").await;
    let deadline = Instant::now() + START;
    while readyz(dep.gateway.base.clone()).await != 503 {
        assert!(
            Instant::now() < deadline,
            "gateway still ready without a decode node"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let sse = dep.gateway.stream(&greedy(8)).await;
    assert_eq!(
        sse.status, 503,
        "a stream must not start without a decode node"
    );
    let (status, v) = dep.gateway.run(&greedy(8)).await;
    assert_eq!(status, 503, "{v}");
    assert!(v.to_string().contains("no prefill or decode node"), "{v}");
    dep.restart("decode").await;
    let deadline = Instant::now() + START;
    while readyz(dep.gateway.base.clone()).await != 200 {
        assert!(
            Instant::now() < deadline,
            "gateway not ready after the restart"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let v = dep.gateway.run_when_up(&greedy(8)).await;
    assert!(!v["result"]["response"].as_str().unwrap().is_empty(), "{v}");
}

/// A decode node that stops reading (SIGSTOP) while the prefill node writes a long
/// prompt's pages into it stalls only the transfer to that node: the prefill node
/// keeps computing and exporting other requests, which complete through the other
/// decode node with their usual answer. (Page writes and flushes run on a transfer
/// worker per decode node, never on the engine thread.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_decode_node_does_not_stop_the_prefill_node_serving_others() {
    let dir = tempfile::tempdir().unwrap();
    let (p, d0, d1) = (free_port(), free_port(), free_port());
    let config = write_config(dir.path(), free_port(), p, &[d0, d1], (CONTEXT, CONTEXT));
    let _decode0 = start_node(dir.path(), &config, "decode", d0).await;
    let decode1 = start_node(dir.path(), &config, "decode", d1).await;
    let _prefill = start_node(dir.path(), &config, "prefill", p).await;
    let gateway = start_config_gateway(dir.path(), &config, "data", "gateway.log", &[]).await;
    // The answer to compare with, with both decode nodes running.
    let solo = gateway.run_when_up(&greedy(24)).await;
    // A long request occupies decode node 0 (fewest outstanding, lowest index), a
    // second long one goes to decode node 1, which then stops: the prefill node
    // computes its prompt and blocks writing the pages to it.
    let long = |max: usize| {
        let words: Vec<&str> = std::iter::repeat_n("apple", 1500).collect();
        json!({"prompt": words.join(" "), "max_tokens": max, "temperature": 0})
    };
    let _busy = gateway.stream(&long(4)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut stalled = gateway.stream(&long(4)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = decode1.id().unwrap().to_string();
    let stop = |sig: &str| {
        assert!(std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
            .success())
    };
    stop("-STOP");
    // New requests go to decode node 0 (fewer outstanding); each needs the prefill
    // node, which also holds the stalled transfer.
    let mut answers = Vec::new();
    for _ in 0..2 {
        let (status, v) = gateway.run(&greedy(24)).await;
        answers.push((status, v));
    }
    stop("-CONT");
    for (status, v) in &answers {
        assert_eq!(*status, 200, "{v}");
        // The same answer and counts; only the prompt tokens served from the prefill
        // node's prefix cache may differ (the solo run was a miss).
        let counts = |v: &serde_json::Value| {
            let u = &v["result"]["usage"];
            (
                v["result"]["response"].clone(),
                u["prompt_tokens"].clone(),
                u["completion_tokens"].clone(),
            )
        };
        assert_eq!(counts(v), counts(&solo), "answer changed under the stall");
    }
    // Once resumed, the stalled request ends too: complete, or (if its flush timed
    // out meanwhile) with an error event, never a truncated success.
    stalled
        .read_until(REQUEST, |e| {
            e.contains(&Ev::Done) || e.iter().any(|e| matches!(e, Ev::Error(_)))
        })
        .await;
    assert!(
        stalled.has_done() != stalled.has_error(),
        "{:?}",
        stalled.events
    );
}

/// The gateway dies (SIGKILL) while a long prompt's pages are being computed and
/// written into the decode node: neither node may free a page a write can still
/// reach, and none may leak. The decode node quarantines the reservation, the prefill
/// node drains and says so, and then every decode page is free again: a new gateway's
/// pool-full request (it needs every page) completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gateway_killed_mid_transfer_leaks_no_node_page() {
    let mut dep = Deployment::start().await;
    let _s = dep.gateway.stream(&long_prompt(8)).await;
    tokio::time::sleep(Duration::from_millis(1500)).await;
    dep.replace_gateway().await;
    dep.pool_is_free().await;
}

/// `echo` with `logprobs` sends the prompt's log probabilities inside one control
/// frame per node link (prefill -> decode -> gateway). The gateway refuses a prompt
/// whose entries could overflow a frame with a 400 naming `logprobs`, and the
/// largest prompt it admits with 5 alternatives (OpenAI's most for completions)
/// crosses the real TLS links whole:
/// one entry per prompt token, the first without a value.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn echo_logprobs_fit_the_node_link_frames_or_are_refused() {
    let dep = Deployment::start().await;
    let completions = |words: usize| {
        let client = reqwest::Client::new();
        let url = format!("{}/v1/completions", dep.gateway.base);
        let key = dep.gateway.key.clone();
        async move {
            let body = json!({"model": MODEL_ID, "prompt": "the ".repeat(words).trim_end(),
                              "max_tokens": 2, "temperature": 0, "logprobs": 5, "echo": true});
            let r = client
                .post(url)
                .bearer_auth(key)
                .json(&body)
                .timeout(Duration::from_secs(120))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            (status, r.json::<Value>().await.unwrap())
        }
    };
    let (status, refused) = completions(4400).await;
    assert_eq!(status, 400, "{refused}");
    assert_eq!(refused["error"]["param"], "logprobs", "{refused}");
    // "... limited to 3901 prompt tokens; this prompt has N."
    let msg = refused["error"]["message"].as_str().unwrap();
    let number_after = |pat: &str| -> usize {
        let rest = &msg[msg.find(pat).unwrap_or_else(|| panic!("{msg}")) + pat.len()..];
        rest.split(|c: char| !c.is_ascii_digit())
            .next()
            .unwrap()
            .parse()
            .unwrap()
    };
    let (limit, tokens) = (
        number_after("limited to "),
        number_after("this prompt has "),
    );
    assert!(tokens > limit, "{msg}");
    // Words per token are constant for this text: aim just under the limit.
    let words = (limit - 8) * 4400 / tokens;
    let (status, v) = completions(words).await;
    assert_eq!(status, 200, "{v}\n{}", dep.logs());
    let lp = &v["choices"][0]["logprobs"];
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    assert!(
        prompt_tokens + 16 > limit && prompt_tokens <= limit,
        "{prompt_tokens} vs {limit}"
    );
    let values = lp["token_logprobs"].as_array().unwrap();
    let completion = v["usage"]["completion_tokens"].as_u64().unwrap() as usize;
    assert_eq!(values.len(), prompt_tokens + completion, "{lp}");
    assert!(values[0].is_null());
    assert!(values[1..]
        .iter()
        .all(|x| x.as_f64().is_some_and(|x| x <= 0.0)));
    let tops = lp["top_logprobs"].as_array().unwrap();
    assert!(tops[1..]
        .iter()
        .all(|t| t.as_object().is_some_and(|m| !m.is_empty())));
    dep.pool_is_free().await;
}
