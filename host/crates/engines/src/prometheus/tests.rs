use super::*;
use std::io::{Read, Write};
use std::net::TcpListener;

#[test]
fn absurd_token_counters_are_refused_not_summed() {
    for value in ["NaN", "+Inf", "-5", "1e30"] {
        let text = format!("vllm:generation_tokens_total {value}\n");
        let error = parse_exposition(&text, "vllm:generation_tokens_total", None).expect_err(value);
        assert!(error.to_string().contains("not a token count"), "{error}");
    }
    let fine = parse_exposition(
        "vllm:generation_tokens_total 12\n",
        "vllm:generation_tokens_total",
        None,
    )
    .expect("a count");
    assert_eq!(fine.tokens, 12.0);
}

const VLLM: &str = r#"# HELP vllm:generation_tokens_total Number of generation tokens processed.
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{model_name="llama"} 1000.0
vllm:generation_tokens_total{model_name="other"} 500.0
# TYPE vllm:time_per_output_token_seconds histogram
vllm:time_per_output_token_seconds_bucket{le="0.01",model_name="llama"} 10.0
vllm:time_per_output_token_seconds_bucket{le="0.025",model_name="llama"} 90.0
vllm:time_per_output_token_seconds_bucket{le="0.05",model_name="llama"} 100.0
vllm:time_per_output_token_seconds_bucket{le="+Inf",model_name="llama"} 100.0
vllm:time_per_output_token_seconds_count{model_name="llama"} 100.0
"#;

#[test]
fn parses_vllm_metrics() {
    let s = parse_exposition(
        VLLM,
        "vllm:generation_tokens_total",
        Some("vllm:time_per_output_token_seconds"),
    )
    .expect("parses");
    assert_eq!(s.tokens, 1500.0, "all series summed");
    assert_eq!(
        s.tpot_buckets,
        vec![
            (0.01, 10.0),
            (0.025, 90.0),
            (0.05, 100.0),
            (f64::INFINITY, 100.0)
        ]
    );
    let missing = parse_exposition(VLLM, "sglang:tokens", None).expect_err("no counter");
    assert!(missing.to_string().contains("sglang:tokens"), "{missing}");
}

#[test]
fn quantiles_interpolate_within_buckets() {
    let buckets = [
        (0.01, 10.0),
        (0.025, 90.0),
        (0.05, 100.0),
        (f64::INFINITY, 100.0),
    ];
    let p50 = histogram_quantile(&buckets, 0.5).expect("p50");
    // Rank 50 is half-way through the (0.01, 0.025] bucket's 80 observations.
    assert!((p50 - 0.0175).abs() < 1e-12, "{p50}");
    let p99 = histogram_quantile(&buckets, 0.99).expect("p99");
    assert!((p99 - 0.0475).abs() < 1e-12, "{p99}");
    assert_eq!(histogram_quantile(&[(0.01, 0.0)], 0.5), None);
}

#[test]
fn windows_are_differences_and_survive_a_reset() {
    let a = Scrape {
        tokens: 1000.0,
        tpot_buckets: vec![(0.01, 5.0), (f64::INFINITY, 10.0)],
        requests: None,
    };
    let b = Scrape {
        tokens: 1600.0,
        tpot_buckets: vec![(0.01, 15.0), (f64::INFINITY, 20.0)],
        requests: None,
    };
    let w = window_between(&a, &b);
    assert_eq!(w.tokens, 600);
    assert!(w.tpot_p50_ms > 0.0 && w.tpot_p50_ms <= 10.0, "{w:?}");
    let restarted = Scrape {
        tokens: 40.0,
        tpot_buckets: vec![(0.01, 1.0), (f64::INFINITY, 1.0)],
        requests: None,
    };
    assert_eq!(window_between(&b, &restarted).tokens, 40);
}

#[test]
fn bad_urls_are_explained() {
    for url in [
        "https://x/metrics",
        "ftp://x",
        "http:///metrics",
        "http://x:1/a b",
    ] {
        let error = Target::parse(url).expect_err(url);
        assert!(
            error.to_string().contains("http://HOST:PORT/metrics"),
            "{error}"
        );
    }
    let target = Target::parse("http://127.0.0.1:8000").expect("valid");
    assert_eq!(target.path, "/metrics");
}

#[test]
fn a_query_without_a_path_goes_to_the_default_path_and_a_fragment_is_dropped() {
    let query =
        Target::parse("http://127.0.0.1:8000?name[]=vllm:num_requests_waiting").expect("valid");
    assert_eq!(
        (
            query.host_port.as_str(),
            query.host.as_str(),
            query.path.as_str()
        ),
        (
            "127.0.0.1:8000",
            "127.0.0.1:8000",
            "/metrics?name[]=vllm:num_requests_waiting"
        )
    );
    let with_path = Target::parse("http://h/m?x=1#frag").expect("valid");
    assert_eq!(
        (with_path.host_port.as_str(), with_path.path.as_str()),
        ("h:80", "/m?x=1")
    );
    let only_fragment = Target::parse("http://h:9#top").expect("valid");
    assert_eq!(only_fragment.path, "/metrics");
}

#[test]
fn ipv6_hosts_keep_their_brackets() {
    let target = Target::parse("http://[::1]:8000/metrics").expect("valid");
    assert_eq!(
        (target.host_port.as_str(), target.path.as_str()),
        ("[::1]:8000", "/metrics")
    );
    let default_port = Target::parse("http://[::1]/m").expect("valid");
    assert_eq!(default_port.host_port, "[::1]:80");
    for url in ["http://[::1:8000/metrics", "http://[::1]x:8000/"] {
        assert!(Target::parse(url).is_err(), "{url}");
    }
}

#[test]
fn label_values_may_hold_commas_braces_and_escapes() {
    let line = r#"m_bucket{path="/a,b}{c",quote="say \"hi\"",slash="a\\b",nl="x\ny",le="0.5"} 7 1700000000000 # {trace_id="1"} 0.4"#;
    let sample = parse_sample(line).expect("a sample");
    assert_eq!(sample.name, "m_bucket");
    assert_eq!(sample.value, 7.0);
    let label = |k: &str| {
        sample
            .labels
            .iter()
            .find(|(key, _)| key == k)
            .map(|(_, v)| v.clone())
    };
    assert_eq!(label("path").as_deref(), Some("/a,b}{c"));
    assert_eq!(label("quote").as_deref(), Some("say \"hi\""));
    assert_eq!(label("slash").as_deref(), Some("a\\b"));
    assert_eq!(label("nl").as_deref(), Some("x\ny"));
    assert_eq!(label("le").as_deref(), Some("0.5"));
    assert!(parse_sample("# HELP m help text {with braces}").is_none());
    assert!(parse_sample("# TYPE m counter").is_none());
    assert!(parse_sample("m NaN").expect("NaN").value.is_nan());
    assert_eq!(parse_sample("m +Inf").expect("inf").value, f64::INFINITY);
    assert!(parse_sample(r#"m{a="unterminated} 1"#).is_none());
}

#[test]
fn a_named_histogram_that_is_missing_is_an_error_naming_it_and_its_neighbours() {
    let text = "vllm:generation_tokens_total{engine=\"0\"} 5\n\
                vllm:inter_token_latency_seconds_bucket{le=\"+Inf\"} 1\n\
                vllm:request_time_per_output_token_seconds_bucket{le=\"+Inf\"} 1\n\
                vllm:num_requests_running 1\n";
    let error = parse_exposition(
        text,
        "vllm:generation_tokens_total",
        Some("vllm:time_per_output_token_seconds"),
    )
    .expect_err("missing histogram")
    .to_string();
    assert!(
        error.contains("`vllm:time_per_output_token_seconds`"),
        "{error}"
    );
    assert!(
        error.contains("vllm:inter_token_latency_seconds_bucket"),
        "{error}"
    );
    assert!(
        error.contains("vllm:request_time_per_output_token_seconds_bucket"),
        "{error}"
    );
    assert!(!error.contains("num_requests_running"), "{error}");
    assert!(error.contains("--tpot-histogram"), "{error}");
}

#[test]
fn a_declared_family_without_series_is_present_at_zero() {
    let text = "# HELP sglang:generation_tokens_total Tokens.\n\
                # TYPE sglang:generation_tokens_total counter\n\
                # TYPE sglang:inter_token_latency_seconds histogram\n";
    let scrape = parse_exposition(
        text,
        "sglang:generation_tokens_total",
        Some("sglang:inter_token_latency_seconds"),
    )
    .expect("present, without observations");
    assert_eq!(scrape, Scrape::default());
    // A histogram's TYPE line does not stand in for a different name.
    assert!(parse_exposition(text, "sglang:generation_tokens_total", Some("other")).is_err());
}

#[test]
fn a_window_without_tpot_observations_has_an_unknown_tpot() {
    let a = Scrape {
        tokens: 10.0,
        tpot_buckets: vec![(0.01, 5.0), (f64::INFINITY, 5.0)],
        requests: None,
    };
    let b = Scrape {
        tokens: 20.0,
        ..a.clone()
    };
    let w = window_between(&a, &b);
    assert_eq!(w.tokens, 10);
    assert!(w.tpot_p50_ms.is_nan() && w.tpot_p99_ms.is_nan(), "{w:?}");
    // Without tokens there is no token latency to know: 0 ms, as for any empty window.
    let idle = window_between(&b, &b);
    assert_eq!((idle.tokens, idle.tpot_p99_ms), (0, 0.0));
}

#[test]
fn quantiles_follow_prometheus_rules() {
    // A rank in the +Inf bucket reads the largest finite bound.
    let tail = [(0.01, 1.0), (0.025, 2.0), (f64::INFINITY, 100.0)];
    assert_eq!(histogram_quantile(&tail, 0.99), Some(0.025));
    // Without a +Inf bucket Prometheus answers NaN.
    assert_eq!(histogram_quantile(&[(0.01, 1.0), (0.025, 2.0)], 0.5), None);
    // All observations under vLLM's first bound (10 ms) read as ~9.9 ms at p99.
    let fast = [(0.01, 100.0), (0.025, 100.0), (f64::INFINITY, 100.0)];
    let p99 = histogram_quantile(&fast, 0.99).expect("p99");
    assert!((p99 - 0.0099).abs() < 1e-12, "{p99}");
    // Decreasing counts are raised to stay monotonic.
    let bumpy = [(0.01, 10.0), (0.025, 8.0), (f64::INFINITY, 10.0)];
    let p50 = histogram_quantile(&bumpy, 0.5).expect("p50");
    assert!((p50 - 0.005).abs() < 1e-12, "{p50}");
    assert_eq!(histogram_quantile(&fast, 1.5), Some(f64::INFINITY));
}

/// A loopback endpoint that answers each of `responses`, raw bytes, to one connection in
/// turn, then closes it; the join handle gives back the request heads it read. `None`
/// where `bind` cannot be bound (no IPv6 loopback on this machine).
fn serve_raw(
    bind: &str,
    responses: Vec<Vec<u8>>,
) -> Option<(String, std::thread::JoinHandle<Vec<String>>)> {
    let listener = match TcpListener::bind(bind) {
        Ok(listener) => listener,
        Err(e) => {
            eprintln!("skipped the {bind} endpoint: cannot bind it ({e})");
            return None;
        }
    };
    let url = format!("http://{}/metrics", listener.local_addr().expect("addr"));
    let server = std::thread::spawn(move || {
        let mut heads = Vec::new();
        for response in responses {
            let Ok((mut stream, _)) = listener.accept() else {
                break;
            };
            let mut request = Vec::new();
            let mut chunk = [0u8; 256];
            while !request.ends_with(b"\r\n\r\n") {
                match stream.read(&mut chunk) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => request.extend_from_slice(&chunk[..n]),
                }
            }
            heads.push(String::from_utf8_lossy(&request).into_owned());
            // The client may hang up first (a body over the limit): not the test's concern.
            let _ = stream.write_all(&response);
        }
        heads
    });
    Some((url, server))
}

fn scrape_once(url: &str) -> Result<Scrape, WorkloadError> {
    let mut config = PrometheusConfig::vllm(url);
    config.tpot_histogram = None;
    scrape(&Target::parse(url)?, &config)
}

#[test]
fn chunked_bodies_with_extensions_are_decoded() {
    let chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n\
                    d\r\nvllm:generati\r\n13;ext=1\r\non_tokens_total 42\n\r\n0\r\n\r\n";
    let (url, server) = serve_raw("127.0.0.1:0", vec![chunked.to_vec()]).expect("loopback");
    let scraped = scrape_once(&url).expect("a chunked body");
    assert_eq!(scraped.tokens, 42.0);
    let heads = server.join().expect("server");
    let authority = url
        .trim_start_matches("http://")
        .trim_end_matches("/metrics");
    assert!(
        heads[0].starts_with("GET /metrics HTTP/1.1\r\n"),
        "{}",
        heads[0]
    );
    assert!(
        heads[0]
            .to_ascii_lowercase()
            .contains(&format!("host: {authority}\r\n")),
        "{}",
        heads[0]
    );
}

#[test]
fn a_chunked_body_cut_short_is_an_error_naming_the_url() {
    let cut = b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\nff\r\nshort".to_vec();
    let (url, server) = serve_raw("127.0.0.1:0", vec![cut]).expect("loopback");
    let error = scrape_once(&url).expect_err("cut short").to_string();
    assert!(error.contains(&url), "{error}");
    assert!(error.contains("cannot read the metrics body"), "{error}");
    let _ = server.join();
}

#[test]
fn a_status_other_than_2xx_is_an_error_naming_the_url_and_status() {
    let not_found = b"HTTP/1.1 404 Not Found\r\nContent-Length: 9\r\n\r\nnot found".to_vec();
    let (url, server) = serve_raw("127.0.0.1:0", vec![not_found]).expect("loopback");
    let error = scrape_once(&url).expect_err("404").to_string();
    assert!(error.contains(&url), "{error}");
    assert!(error.contains("404 Not Found"), "{error}");
    assert!(error.contains("metrics URL"), "{error}");
    let _ = server.join();
}

#[test]
fn a_body_over_the_limit_is_refused_naming_the_limit() {
    let size = (16 << 20) + 1;
    let mut huge = format!("HTTP/1.1 200 OK\r\nContent-Length: {size}\r\n\r\n").into_bytes();
    huge.resize(huge.len() + size, b'#');
    let (url, server) = serve_raw("127.0.0.1:0", vec![huge]).expect("loopback");
    let error = scrape_once(&url).expect_err("too large").to_string();
    assert!(error.contains(&url), "{error}");
    assert!(error.contains("more than 16 MiB"), "{error}");
    let _ = server.join();
}

#[test]
fn ipv6_literal_hosts_are_scraped() {
    let body = b"HTTP/1.1 200 OK\r\nContent-Length: 32\r\n\r\nvllm:generation_tokens_total 7\n\n";
    let Some((url, server)) = serve_raw("[::1]:0", vec![body.to_vec()]) else {
        return;
    };
    assert!(url.starts_with("http://[::1]:"), "{url}");
    assert_eq!(scrape_once(&url).expect("scraped over IPv6").tokens, 7.0);
    let heads = server.join().expect("server");
    assert!(
        heads[0].to_ascii_lowercase().contains("host: [::1]:"),
        "{}",
        heads[0]
    );
}

#[test]
fn engine_presets_parse_by_name() {
    for engine in Engine::ALL {
        assert_eq!(engine.name().parse::<Engine>(), Ok(engine));
    }
    let unknown = "llama.cpp".parse::<Engine>().expect_err("not a preset");
    assert!(
        unknown.contains("vllm, sglang, tgi, triton or llamacpp"),
        "{unknown}"
    );
    assert_eq!(Engine::Triton.tpot_histogram(), None);
    assert_eq!(Engine::Llamacpp.tpot_histogram(), None);
}

/// What llama.cpp's `llama-server --metrics` answered on the H200 (b7600-era tree from
/// llama-cpp-python 0.3.36), trimmed: counters whose `# TYPE` names carry `_total`, one
/// series each, no histogram.
const LLAMACPP: &str =
    "# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 9
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 1
# HELP llamacpp:tokens_predicted_total Number of generation tokens processed
# TYPE llamacpp:tokens_predicted_total counter
llamacpp:tokens_predicted_total 96
# HELP llamacpp:n_tokens_max Largest observed sequence length (prompt + generation)
# TYPE llamacpp:n_tokens_max counter
llamacpp:n_tokens_max 70
# HELP llamacpp:predicted_tokens_seconds Average generation throughput in tokens/s
# TYPE llamacpp:predicted_tokens_seconds gauge
llamacpp:predicted_tokens_seconds 805.312
";

#[test]
fn llamacpp_counts_predicted_tokens_and_has_no_latency_histogram() {
    let engine = Engine::Llamacpp;
    let scrape = parse_exposition(LLAMACPP, engine.token_counter(), engine.tpot_histogram())
        .expect("parses");
    assert_eq!(scrape.tokens, 96.0, "predicted tokens, not the prompt's 9");
    assert!(scrape.tpot_buckets.is_empty());
    // Tokens with no histogram behind them: the TPOT is unknown, never 0 ms.
    let later = Scrape {
        tokens: 160.0,
        ..scrape.clone()
    };
    let window = window_between(&scrape, &later);
    assert_eq!(window.tokens, 64);
    assert!(
        window.tpot_p99_ms.is_nan() && window.tpot_p50_ms.is_nan(),
        "{window:?}"
    );
    assert_eq!(window.requests, None, "no TTFT histogram: no requests read");
}

/// A metrics server on loopback whose counter grows by 100 per scrape.
fn serve(listener: TcpListener, scrapes: u32) {
    for n in 0..scrapes {
        let Ok((mut stream, _)) = listener.accept() else {
            return;
        };
        // Read the whole request, so closing does not reset the connection.
        let mut request = Vec::new();
        let mut chunk = [0u8; 256];
        while !request.ends_with(b"\r\n\r\n") {
            match stream.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => request.extend_from_slice(&chunk[..n]),
            }
        }
        let body = format!("vllm:generation_tokens_total {}\n", 100 * (n + 1));
        let _ = write!(
            stream,
            "HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\n{body}"
        );
    }
}

#[test]
fn scrapes_a_live_endpoint_off_the_loop() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let url = format!("http://{}/metrics", listener.local_addr().expect("addr"));
    let server = std::thread::spawn(move || serve(listener, 3));
    let mut config = PrometheusConfig::vllm(&url);
    config.tpot_histogram = None;
    config.period = Duration::from_millis(20);
    let mut tokens = PrometheusTokens::start(config).expect("starts");
    // Wait (without asserting on time) until the scraper has seen the third value.
    let mut total = 0;
    for _ in 0..500 {
        total += tokens.read_window(0).expect("window").tokens;
        if total >= 200 {
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(
        total,
        200,
        "100 → 300 over the scrapes ({} failed)",
        tokens.failures()
    );
    assert!(matches!(
        tokens.set_batch_size(0, 8),
        Err(WorkloadError::BatchFixed(_))
    ));
    drop(tokens);
    let _ = server.join();
}

#[test]
fn a_dead_endpoint_is_a_clear_error_at_start() {
    // Bind then drop: nothing listens on that port any more.
    let port = TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("port")
        .port();
    let error = PrometheusTokens::start(PrometheusConfig::vllm(&format!(
        "http://127.0.0.1:{port}/metrics"
    )))
    .expect_err("refused");
    assert!(error.to_string().contains("cannot connect"), "{error}");
}

/// vLLM's time to first token and prompt tokens, as its exposition writes them (two
/// engine cores, one model): the window's first tokens, their p99 and the prompt tokens.
#[test]
fn the_requests_come_from_the_ttft_histogram_and_the_prompt_counter() {
    let exposition = |prompt: f64, fast: f64, all: f64| {
        format!(
            "# TYPE vllm:generation_tokens_total counter\n\
             vllm:generation_tokens_total{{engine=\"0\",model_name=\"m\"}} 100\n\
             # TYPE vllm:prompt_tokens_total counter\n\
             vllm:prompt_tokens_total{{engine=\"0\",model_name=\"m\"}} {prompt}\n\
             vllm:prompt_tokens_total{{engine=\"1\",model_name=\"m\"}} {prompt}\n\
             # TYPE vllm:time_to_first_token_seconds histogram\n\
             vllm:time_to_first_token_seconds_bucket{{engine=\"0\",le=\"0.1\",model_name=\"m\"}} {fast}\n\
             vllm:time_to_first_token_seconds_bucket{{engine=\"0\",le=\"1.0\",model_name=\"m\"}} {all}\n\
             vllm:time_to_first_token_seconds_bucket{{engine=\"0\",le=\"+Inf\",model_name=\"m\"}} {all}\n"
        )
    };
    let metrics = Engine::Vllm
        .request_metrics()
        .expect("vLLM times first tokens");
    let read = |text: &str| {
        parse_scrape(text, "vllm:generation_tokens_total", None, Some(&metrics)).expect("parses")
    };
    let start = read(&exposition(1000.0, 10.0, 10.0));
    let end = read(&exposition(5096.0, 10.0, 30.0));
    let requests = window_between(&start, &end)
        .requests
        .expect("requests read");
    assert_eq!(requests.prefill_tokens, 8192);
    assert_eq!(requests.first_tokens, 20);
    // All 20 of the window's first tokens fell between 0.1 and 1 s: the p99 interpolates
    // near the top of that bucket.
    let p99 = requests.ttft_p99_ms.expect("a TTFT");
    assert!((900.0..=1000.0).contains(&p99), "{p99}");
    // What the engine cannot know stays unknown.
    assert_eq!(requests.prefill_time_share, None);
    assert_eq!(requests.energy, None);
    // No first token in a window: no TTFT, not a zero one.
    let idle = window_between(&end, &end).requests.expect("requests read");
    assert_eq!((idle.first_tokens, idle.ttft_p99_ms), (0, None));

    // A named TTFT histogram the exposition lacks is refused, naming the flag.
    let missing = parse_scrape(
        &exposition(1.0, 1.0, 1.0).replace("time_to_first_token", "ttft"),
        "vllm:generation_tokens_total",
        None,
        Some(&metrics),
    )
    .expect_err("no TTFT histogram");
    assert!(
        missing.to_string().contains("--ttft-histogram"),
        "{missing}"
    );
}

#[test]
fn the_presets_say_which_engines_time_first_tokens() {
    assert!(Engine::Vllm.request_metrics().is_some());
    assert!(Engine::Sglang.request_metrics().is_some());
    assert!(Engine::Tgi.request_metrics().is_none());
    assert!(Engine::Triton.request_metrics().is_none());
    // llama.cpp counts prompt tokens but times no first token.
    assert!(Engine::Llamacpp.request_metrics().is_none());
    assert_eq!(
        Engine::Llamacpp.prompt_counter(),
        Some("llamacpp:prompt_tokens_total")
    );
    assert_eq!(request_metrics(Engine::Llamacpp, None, None), Ok(None));
    // A TTFT histogram named for it (a proxy's, say) is read beside its own prompt counter.
    let named = request_metrics(Engine::Llamacpp, Some("proxy_ttft".into()), None)
        .expect("named")
        .expect("read");
    assert_eq!(named.prompt_counter, "llamacpp:prompt_tokens_total");
    // TGI's own names can be given; a TTFT histogram without a prompt counter cannot.
    let named = request_metrics(
        Engine::Tgi,
        Some("my_ttft".into()),
        Some("my_prompts".into()),
    )
    .expect("named");
    assert_eq!(named.map(|m| m.ttft_histogram), Some("my_ttft".to_owned()));
    let err = request_metrics(Engine::Tgi, Some("my_ttft".into()), None).expect_err("no counter");
    assert!(err.contains("--prompt-counter"), "{err}");
    assert_eq!(
        request_metrics(Engine::Vllm, Some(String::new()), None),
        Ok(None)
    );
}
