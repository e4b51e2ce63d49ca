//! The control API end to end: the server on a socket and on loopback HTTP in this test
//! process, in front of a fake `Control` that records every call (so a bad request is
//! shown to change nothing), driven by raw HTTP, by `ApiClient` and by the built
//! `tokwatt status` / `tokwatt policy` commands.

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use tokwatt_serve::api::load::hammer;
use tokwatt_serve::api::{
    ActionOutcome, ApiClient, ApiConfig, ApiError, ApiServer, ClientError, Control, ControlError,
    ENDPOINTS, FleetStatus, GpuStatus, MAX_BODY_BYTES, NodeStatus, SwapRequest,
};

use crate::support::{stderr, tempdir, tokwatt};

const TOKEN: &str = "test-token-5f2c9a";

/// A `Control` that records calls and answers what the test set.
#[derive(Default)]
struct FakeControl {
    calls: Mutex<Vec<String>>,
    /// Every action fails with this, when set.
    refuse_with: Mutex<Option<ControlError>>,
    /// A swap says it has arrived on the first, then waits for a message on the second.
    swap_gate: Mutex<Option<(mpsc::Sender<()>, mpsc::Receiver<()>)>>,
    metrics_text: String,
}

impl FakeControl {
    fn calls(&self) -> Vec<String> {
        self.calls.lock().expect("calls").clone()
    }

    fn act(&self, call: String) -> Result<ActionOutcome, ControlError> {
        self.calls.lock().expect("calls").push(call.clone());
        if let Some(error) = self.refuse_with.lock().expect("refusal").clone() {
            return Err(error);
        }
        Ok(ActionOutcome {
            message: format!("done: {call}"),
            tick: 42,
            policy: "fake-policy".into(),
            state_carried: call.starts_with("swap").then_some(true),
        })
    }
}

fn sample_status() -> NodeStatus {
    let mut status = NodeStatus {
        api_version: tokwatt_serve::api::API_VERSION,
        agent_version: "test".into(),
        simulated: true,
        data_source: "simulator (h200 profile)".into(),
        ticks: 1234,
        fleet: Some(FleetStatus {
            domain: "rack-7".into(),
            node: "gpu-node-3".into(),
            allowance_w: Some(2800.0),
            holding: Some(tokwatt_serve::api::Holding::Grant),
            reserve_w: Some(1000.0),
            grant: Some(tokwatt_serve::api::GrantStatus {
                watts: 2800.0,
                generation: 7,
                acknowledged: true,
            }),
            lease: Some(tokwatt_serve::api::LeaseStatus {
                id: "694d".into(),
                holds_for_s: 1.5,
            }),
            apart_because: None,
        }),
        ..NodeStatus::default()
    };
    status.policy.name = "fake-policy".into();
    status.policy.version = "0123456789ab".into();
    status.gpus.push(GpuStatus {
        gpu: 0,
        name: "H200".into(),
        last_tokens_per_joule: Some(3.5),
        last_power_w: Some(412.0),
        ..GpuStatus::default()
    });
    status.node = Some(tokwatt_serve::api::NodeTotals::of(&status.gpus));
    status
}

impl Control for FakeControl {
    fn status(&self) -> NodeStatus {
        self.calls.lock().expect("calls").push("status".into());
        sample_status()
    }
    fn metrics(&self) -> String {
        self.calls.lock().expect("calls").push("metrics".into());
        self.metrics_text.clone()
    }
    fn swap(&self, request: &SwapRequest) -> Result<ActionOutcome, ControlError> {
        let gate = self.swap_gate.lock().expect("gate").take();
        if let Some((arrived, release)) = gate {
            arrived.send(()).expect("the test waits for the swap");
            release.recv().expect("the test releases the swap");
        }
        let plugin = request
            .plugin
            .as_ref()
            .map(|p| format!(" plugin {}", p.display()))
            .unwrap_or_default();
        self.act(format!("swap {}{plugin}", request.spec.display()))
    }
    fn rollback(&self) -> Result<ActionOutcome, ControlError> {
        self.act("rollback".into())
    }
    fn pause(&self) -> Result<ActionOutcome, ControlError> {
        self.act("pause".into())
    }
    fn resume(&self) -> Result<ActionOutcome, ControlError> {
        self.act("resume".into())
    }
    fn restore_defaults(&self) -> Result<ActionOutcome, ControlError> {
        self.act("restore-defaults".into())
    }
}

/// A server on a socket, loopback HTTP (with a token file) and a metrics address.
struct Served {
    _dir: tempfile::TempDir,
    socket: PathBuf,
    token_file: PathBuf,
    server: ApiServer,
    control: Arc<FakeControl>,
}

impl Served {
    fn start() -> Self {
        Self::start_with(FakeControl {
            metrics_text: "# TYPE tokwatt_ticks counter\ntokwatt_ticks_total 7\n# EOF\n".into(),
            ..FakeControl::default()
        })
    }

    fn start_with(control: FakeControl) -> Self {
        let dir = tempdir();
        let socket = dir.path().join("run").join("tokwatt.sock");
        let token_file = write_token(dir.path(), TOKEN);
        let control = Arc::new(control);
        let server = ApiServer::start(
            ApiConfig {
                socket: Some(socket.clone()),
                http: Some("127.0.0.1:0".parse().expect("addr")),
                token_file: Some(token_file.clone()),
                metrics: Some("127.0.0.1:0".parse().expect("addr")),
            },
            control.clone(),
        )
        .expect("the API starts");
        Self {
            _dir: dir,
            socket,
            token_file,
            server,
            control,
        }
    }

    fn url(&self) -> String {
        format!("http://{}", self.server.http_addr().expect("http"))
    }

    fn over_socket(&self, request: &[u8]) -> Answer {
        let stream = std::os::unix::net::UnixStream::connect(&self.socket).expect("connect");
        stream
            .set_read_timeout(Some(Duration::from_secs(30)))
            .expect("timeout");
        exchange(stream, request)
    }

    fn over_http(&self, request: &[u8]) -> Answer {
        over_tcp(self.server.http_addr().expect("http"), request)
    }
}

fn over_tcp(addr: std::net::SocketAddr, request: &[u8]) -> Answer {
    let stream = std::net::TcpStream::connect(addr).expect("connect");
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .expect("timeout");
    exchange(stream, request)
}

fn write_token(dir: &Path, token: &str) -> PathBuf {
    let path = dir.join(format!("token-{}", token.len()));
    std::fs::write(&path, format!("{token}\n")).expect("write token");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    path
}

#[derive(Debug)]
struct Answer {
    status: u16,
    head: String,
    body: String,
}

impl Answer {
    fn error(&self) -> String {
        let value: serde_json::Value = serde_json::from_str(&self.body)
            .unwrap_or_else(|_| panic!("the error is JSON: {}", self.body));
        value["error"]
            .as_str()
            .unwrap_or_else(|| panic!("no error key: {}", self.body))
            .to_owned()
    }
}

fn exchange(mut stream: impl Read + Write, request: &[u8]) -> Answer {
    // A refused body may be cut short by the server; the answer is what counts.
    let _ = stream.write_all(request);
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).expect("read the answer");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").expect("a head and a body");
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or_else(|| panic!("a status line: {head}"));
    Answer {
        status,
        head: head.to_owned(),
        body: body.to_owned(),
    }
}

fn request(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    let mut text = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in headers {
        text.push_str(&format!("{name}: {value}\r\n"));
    }
    text.push_str("\r\n");
    let mut bytes = text.into_bytes();
    bytes.extend_from_slice(body);
    bytes
}

const JSON: (&str, &str) = ("Content-Type", "application/json");

#[test]
fn the_socket_is_mode_600_in_a_new_0700_folder_and_removed_on_shutdown() {
    let served = Served::start();
    let socket_mode = std::fs::symlink_metadata(&served.socket)
        .expect("socket")
        .permissions()
        .mode();
    assert_eq!(socket_mode & 0o777, 0o600);
    let folder_mode = std::fs::metadata(served.socket.parent().expect("folder"))
        .expect("folder")
        .permissions()
        .mode();
    assert_eq!(folder_mode & 0o077, 0, "folder mode {folder_mode:o}");
    assert_eq!(served.server.socket_path(), Some(served.socket.as_path()));
    let socket = served.socket.clone();
    let leftovers = |folder: &Path| std::fs::read_dir(folder).expect("list").count();
    assert_eq!(
        leftovers(socket.parent().expect("folder")),
        1,
        "no staging file left"
    );
    served.server.shutdown();
    assert!(!socket.exists(), "the socket file is removed on shutdown");
}

#[test]
fn status_round_trips_through_the_client_on_the_socket_and_http() {
    let served = Served::start();
    let over_socket = ApiClient::unix(&served.socket)
        .expect("client")
        .status()
        .expect("status");
    assert_eq!(over_socket, sample_status());
    let over_http = ApiClient::http(&served.url(), TOKEN)
        .expect("client")
        .status()
        .expect("status");
    assert_eq!(over_http, sample_status());
    let outcome = ApiClient::unix(&served.socket)
        .expect("client")
        .pause()
        .expect("pause");
    assert_eq!(outcome.message, "done: pause");
    assert_eq!(outcome.tick, 42);
    assert_eq!(served.control.calls(), ["status", "status", "pause"]);
}

#[test]
fn every_endpoint_over_http_wants_the_token_unknown_paths_included() {
    let served = Served::start();
    let mut targets: Vec<(&str, &str)> = ENDPOINTS.to_vec();
    targets.extend([("GET", "/nope"), ("POST", "/v1/status"), ("GET", "/")]);
    let wrong = "Bearer not-the-token";
    for (method, path) in targets {
        for authorization in [None, Some(wrong), Some("Basic dGVzdA==")] {
            let headers: Vec<(&str, &str)> = authorization
                .map(|value| ("Authorization", value))
                .into_iter()
                .chain([JSON])
                .collect();
            let answer = served.over_http(&request(method, path, &headers, b"{}"));
            assert_eq!(
                answer.status, 401,
                "{method} {path} with {authorization:?}: {answer:?}"
            );
            assert!(answer.error().contains("bearer token"), "{answer:?}");
            assert!(
                !answer.body.contains("endpoints"),
                "a 401 tells nothing else"
            );
        }
    }
    assert!(
        served.control.calls().is_empty(),
        "{:?}",
        served.control.calls()
    );

    let bearer = format!("Bearer {TOKEN}");
    let answer = served.over_http(&request(
        "GET",
        "/v1/status",
        &[("Authorization", &bearer)],
        b"",
    ));
    assert_eq!(answer.status, 200, "{answer:?}");
    let error = ApiClient::http(&served.url(), "wrong")
        .expect("client")
        .status()
        .expect_err("wrong token");
    assert_eq!(error.status(), Some(401));
    assert!(error.to_string().contains("401: the token"), "{error}");
}

#[test]
fn http_off_loopback_or_without_a_private_token_file_is_refused() {
    let dir = tempdir();
    let token_file = write_token(dir.path(), TOKEN);
    let start = |http: &str, token_file: Option<PathBuf>| {
        ApiServer::start(
            ApiConfig {
                http: Some(http.parse().expect("addr")),
                token_file,
                ..ApiConfig::default()
            },
            Arc::new(FakeControl::default()),
        )
    };
    for address in ["0.0.0.0:0", "[::]:0", "192.0.2.1:8321"] {
        let error = start(address, Some(token_file.clone())).expect_err(address);
        assert!(matches!(error, ApiError::NotLoopback { .. }), "{error}");
        assert!(error.to_string().contains("127.0.0.1:PORT"), "{error}");
    }
    let error = start("127.0.0.1:0", None).expect_err("no token file");
    assert!(error.to_string().contains("--token-file"), "{error}");

    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let error = start("127.0.0.1:0", Some(token_file.clone())).expect_err("world-readable");
    assert!(
        error
            .to_string()
            .contains(&format!("chmod 600 {}", token_file.display())),
        "{error}"
    );
    std::fs::set_permissions(&token_file, std::fs::Permissions::from_mode(0o600)).expect("chmod");
    start("127.0.0.1:0", Some(token_file)).expect("a private token file on loopback starts");
}

#[test]
fn bad_requests_get_4xx_with_the_fix_and_reach_nothing() {
    let served = Served::start();
    let oversized = {
        let mut body = b"{\"spec\": \"/a.toml\", \"pad\": \"".to_vec();
        body.resize(MAX_BODY_BYTES + 40 * 1024, b'x');
        body.extend_from_slice(b"\"}");
        body
    };
    let cases: Vec<(Vec<u8>, u16, &str)> = vec![
        (
            request("POST", "/v1/policy/swap", &[JSON], b"{\"spec\": "),
            400,
            "not valid JSON",
        ),
        (
            request(
                "POST",
                "/v1/policy/swap",
                &[JSON],
                br#"{"spec": "/a.toml", "plugn": "/b"}"#,
            ),
            400,
            "unknown key `plugn`",
        ),
        (
            request("POST", "/v1/policy/swap", &[JSON], br#"{"spec": 7}"#),
            400,
            "key `spec` must be a string",
        ),
        (
            request(
                "POST",
                "/v1/policy/swap",
                &[JSON],
                br#"{"spec": "policies/a.toml"}"#,
            ),
            400,
            "must be an absolute path",
        ),
        (
            request("POST", "/v1/policy/swap", &[JSON], &oversized),
            413,
            "larger than 65536",
        ),
        (
            request(
                "POST",
                "/v1/policy/swap",
                &[("Content-Type", "text/plain")],
                br#"{"spec": "/a.toml"}"#,
            ),
            415,
            "Content-Type: application/json",
        ),
        (
            request("POST", "/v1/policy/swap", &[], br#"{"spec": "/a.toml"}"#),
            415,
            "Content-Type: application/json",
        ),
        (
            request("POST", "/v1/policy/swap", &[JSON], b""),
            400,
            "no body",
        ),
        (
            request("POST", "/v1/pause", &[JSON], br#"{"now": true}"#),
            400,
            "no parameters",
        ),
        (request("GET", "/v1/pause", &[], b""), 405, "use POST"),
        (request("DELETE", "/v1/status", &[], b""), 405, "use GET"),
        (
            request("GET", "/v2/status", &[], b""),
            404,
            "POST /v1/policy/swap",
        ),
    ];
    for (bytes, status, fix) in &cases {
        let answer = served.over_socket(bytes);
        let line = String::from_utf8_lossy(&bytes[..bytes.len().min(60)]).into_owned();
        assert_eq!(answer.status, *status, "{line}: {answer:?}");
        assert!(
            answer.error().contains(fix),
            "{line}: {:?} lacks {fix:?}",
            answer.error()
        );
        assert!(
            answer
                .head
                .to_ascii_lowercase()
                .contains("application/json"),
            "{answer:?}"
        );
    }
    assert!(
        served.control.calls().is_empty(),
        "{:?}",
        served.control.calls()
    );

    // The same checks hold over HTTP, past the token.
    let bearer = format!("Bearer {TOKEN}");
    let answer = served.over_http(&request(
        "POST",
        "/v1/policy/swap",
        &[JSON, ("Authorization", &bearer)],
        br#"{"spec": "relative.toml"}"#,
    ));
    assert_eq!(answer.status, 400, "{answer:?}");
    assert!(served.control.calls().is_empty());

    // And a good one reaches the fake, empty-object body accepted for an action.
    let answer = served.over_socket(&request("POST", "/v1/resume", &[JSON], b"{}"));
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(served.control.calls(), ["resume"]);
}

#[test]
fn control_errors_map_to_400_409_503_and_the_cli_prints_the_message() {
    let served = Served::start();
    let cases = [
        (
            ControlError::BadRequest("spec /x.toml: no such file".into()),
            400,
        ),
        (
            ControlError::Conflict("no previous policy to roll back to".into()),
            409,
        ),
        (
            ControlError::Unavailable("the agent is stopping".into()),
            503,
        ),
    ];
    for (error, status) in cases {
        let message = error.to_string();
        *served.control.refuse_with.lock().expect("refusal") = Some(error);
        let answer = served.over_socket(&request("POST", "/v1/policy/rollback", &[], b""));
        assert_eq!(answer.status, status, "{answer:?}");
        assert_eq!(answer.error(), message);

        let output = tokwatt()
            .args(["policy", "rollback", "--socket"])
            .arg(&served.socket)
            .output()
            .expect("tokwatt runs");
        assert!(!output.status.success(), "exit non-zero on {status}");
        let stderr = stderr(&output);
        assert!(stderr.contains(&message), "{stderr}");
        assert!(stderr.contains(&format!("HTTP {status}")), "{stderr}");

        let client_error = ApiClient::unix(&served.socket)
            .expect("client")
            .rollback()
            .expect_err("refused");
        assert_eq!(client_error.status(), Some(status));
    }
}

#[test]
fn a_stale_socket_is_replaced_a_live_one_and_other_files_refused() {
    let dir = tempdir();
    let path = dir.path().join("tokwatt.sock");
    drop(std::os::unix::net::UnixListener::bind(&path).expect("bind"));
    assert!(path.exists(), "a stale socket file is left behind");
    let config = ApiConfig {
        socket: Some(path.clone()),
        ..ApiConfig::default()
    };
    let first = ApiServer::start(config.clone(), Arc::new(FakeControl::default()))
        .expect("the stale socket is replaced");
    ApiClient::unix(&path)
        .expect("client")
        .status()
        .expect("the new socket answers");

    let error = ApiServer::start(config.clone(), Arc::new(FakeControl::default()))
        .expect_err("a live socket");
    assert!(matches!(error, ApiError::AlreadyServing { .. }), "{error}");
    assert!(
        error.to_string().contains("another tokwatt serves on"),
        "{error}"
    );
    ApiClient::unix(&path)
        .expect("client")
        .status()
        .expect("the first one still answers");
    first.shutdown();

    std::fs::write(&path, "not a socket").expect("write");
    let error =
        ApiServer::start(config, Arc::new(FakeControl::default())).expect_err("a regular file");
    assert!(matches!(error, ApiError::NotASocket { .. }), "{error}");
    assert_eq!(
        std::fs::read_to_string(&path).expect("kept"),
        "not a socket"
    );
}

#[test]
fn the_metrics_listener_serves_metrics_and_health_without_a_token() {
    let served = Served::start();
    let addr = served.server.metrics_addr().expect("metrics");
    let answer = over_tcp(addr, &request("GET", "/metrics", &[], b""));
    assert_eq!(answer.status, 200, "{answer:?}");
    assert!(
        answer.head.contains("text/plain; version=0.0.4"),
        "{answer:?}"
    );
    assert!(answer.body.contains("tokwatt_ticks_total 7"));
    let answer = over_tcp(addr, &request("GET", "/healthz", &[], b""));
    assert_eq!(answer.status, 200, "{answer:?}");
    let answer = over_tcp(addr, &request("POST", "/v1/pause", &[], b""));
    assert_eq!(
        answer.status, 404,
        "the metrics listener takes no actions: {answer:?}"
    );
    assert_eq!(served.control.calls(), ["metrics"]);

    // The control socket serves them too; plain Prometheus text gets its own type.
    let plain = Served::start_with(FakeControl {
        metrics_text: "tokwatt_ticks_total 7\n".into(),
        ..FakeControl::default()
    });
    let answer = plain.over_socket(&request("GET", "/metrics", &[], b""));
    assert!(
        answer.head.contains("text/plain; version=0.0.4"),
        "{answer:?}"
    );
    assert_eq!(
        ApiClient::unix(&plain.socket)
            .expect("client")
            .metrics()
            .expect("metrics"),
        "tokwatt_ticks_total 7\n"
    );
}

#[test]
fn status_answers_while_a_swap_waits_for_its_tick() {
    let (release, released) = mpsc::channel();
    let (arrive, arrived) = mpsc::channel();
    let served = Served::start_with(FakeControl {
        swap_gate: Mutex::new(Some((arrive, released))),
        ..FakeControl::default()
    });
    let socket = served.socket.clone();
    let swapping = std::thread::spawn(move || {
        ApiClient::unix(&socket)
            .expect("client")
            .swap(&SwapRequest {
                spec: "/policies/b.toml".into(),
                plugin: None,
                fresh: false,
            })
    });
    arrived.recv().expect("the swap reaches the agent");
    let client = ApiClient::unix(&served.socket)
        .expect("client")
        .with_timeout(Duration::from_secs(20));
    for _ in 0..3 {
        client
            .status()
            .expect("status answers while a swap is in flight");
    }
    assert!(!swapping.is_finished(), "the swap is still held");
    release.send(()).expect("release");
    let outcome = swapping.join().expect("thread").expect("swap");
    assert_eq!(outcome.state_carried, Some(true));
}

#[test]
fn the_load_tool_counts_every_request_on_both_transports() {
    let served = Served::start();
    let socket = served.socket.clone();
    let report = hammer(
        || ApiClient::unix(&socket),
        100.0,
        Duration::from_millis(300),
    )
    .expect("load run");
    assert_eq!(report.sent, 30);
    assert_eq!((report.ok, report.errors), (30, 0), "{report:?}");
    let (p50, p99) = (
        report.latency_p50_ms.expect("p50"),
        report.latency_p99_ms.expect("p99"),
    );
    assert!(p50 > 0.0 && p50 <= p99, "{report:?}");

    let url = served.url();
    let report = hammer(
        || ApiClient::http(&url, TOKEN),
        100.0,
        Duration::from_millis(200),
    )
    .expect("load run");
    assert_eq!(
        (report.sent, report.ok, report.errors),
        (20, 20, 0),
        "{report:?}"
    );

    let report = hammer(
        || ApiClient::http(&url, "wrong"),
        50.0,
        Duration::from_millis(100),
    )
    .expect("load run");
    assert_eq!((report.ok, report.errors), (0, 5), "{report:?}");
    assert_eq!(report.latency_p50_ms, None, "no latency without an answer");
    assert!(report.first_error.expect("error").contains("401"));
}

#[test]
fn tokwatt_status_and_policy_swap_talk_to_a_served_agent() {
    let served = Served::start();
    let output = tokwatt()
        .args(["status", "--socket"])
        .arg(&served.socket)
        .output()
        .expect("tokwatt runs");
    assert!(output.status.success(), "{}", stderr(&output));
    let text = String::from_utf8_lossy(&output.stdout);
    for expected in [
        "SIMULATED",
        "fake-policy (version 0123456789ab)",
        "H200",
        "3.500",
        "412.0",
        "node gpu-node-3 in power domain rack-7: holding its grant: 2800 W (#7, acknowledged)",
        "lease 694d",
    ] {
        assert!(text.contains(expected), "{expected:?} missing:\n{text}");
    }

    let output = tokwatt()
        .args(["status", "--json", "--url", &served.url(), "--token-file"])
        .arg(&served.token_file)
        .output()
        .expect("tokwatt runs");
    assert!(output.status.success(), "{}", stderr(&output));
    let status: NodeStatus = serde_json::from_slice(&output.stdout).expect("JSON status");
    assert_eq!(status, sample_status());
    // `fleet` and `node` are additive within API version 1: the keys as scripts read
    // them, and a status from an agent that predates them (no key, or a `fleet` with its
    // domain and node only) still parses.
    let mut json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(json["api_version"], 1);
    assert_eq!(
        json["fleet"],
        serde_json::json!({
            "domain": "rack-7",
            "node": "gpu-node-3",
            "allowance_w": 2800.0,
            "holding": "grant",
            "reserve_w": 1000.0,
            "grant": {"watts": 2800.0, "generation": 7, "acknowledged": true},
            "lease": {"id": "694d", "holds_for_s": 1.5},
            "apart_because": null,
        })
    );
    let node = &json["node"];
    for key in [
        "gpus",
        "power_cap_w",
        "last_power_w",
        "last_tokens_per_s",
        "last_tokens_per_joule",
        "tokens",
        "energy_j",
        "tokens_per_joule",
    ] {
        assert!(node.get(key).is_some(), "`node.{key}` missing: {node}");
    }
    assert_eq!(node["gpus"], 1);
    assert_eq!(node["last_power_w"], 412.0);
    let mut older_fleet = json.clone();
    older_fleet["fleet"] = serde_json::json!({"domain": "rack-7", "node": "gpu-node-3"});
    let older: NodeStatus =
        serde_json::from_value(older_fleet).expect("a fleet without its allowance");
    let place = older.fleet.expect("a domain");
    assert_eq!(
        (place.allowance_w, place.grant, place.lease),
        (None, None, None)
    );
    let object = json.as_object_mut().expect("an object");
    object.remove("fleet");
    object.remove("node");
    let older: NodeStatus = serde_json::from_value(json).expect("a status without `fleet`");
    assert_eq!((older.fleet, older.node), (None, None));

    let work = tempdir();
    let output = tokwatt()
        .current_dir(work.path())
        .args([
            "policy",
            "swap",
            "specs/next.toml",
            "--plugin",
            "next.wasm",
            "--socket",
        ])
        .arg(&served.socket)
        .output()
        .expect("tokwatt runs");
    assert!(output.status.success(), "{}", stderr(&output));
    let expected = format!(
        "swap {} plugin {}",
        work.path().join("specs/next.toml").display(),
        work.path().join("next.wasm").display()
    );
    assert!(
        served.control.calls().contains(&expected),
        "{:?}",
        served.control.calls()
    );
    let printed = String::from_utf8_lossy(&output.stdout);
    assert!(printed.contains(&format!("done: {expected}")), "{printed}");
    assert!(printed.contains("took the old one's state"), "{printed}");

    for action in ["pause", "resume", "restore-defaults"] {
        let output = tokwatt()
            .args(["policy", action, "--socket"])
            .arg(&served.socket)
            .output()
            .expect("tokwatt runs");
        assert!(output.status.success(), "{action}: {}", stderr(&output));
    }
    let calls = served.control.calls();
    assert_eq!(
        &calls[calls.len() - 3..],
        ["pause", "resume", "restore-defaults"]
    );
}

#[test]
fn the_cli_names_the_fix_when_it_cannot_reach_the_agent() {
    let served = Served::start();
    let dir = tempdir();
    let missing = dir.path().join("missing.sock");
    let output = tokwatt()
        .args(["status", "--socket"])
        .arg(&missing)
        .output()
        .expect("tokwatt runs");
    assert!(!output.status.success());
    let text = stderr(&output);
    assert!(text.contains("is `tokwatt serve` running?"), "{text}");
    assert!(text.contains(&missing.display().to_string()), "{text}");

    let wrong = write_token(dir.path(), "not-the-agents-token");
    let output = tokwatt()
        .args(["status", "--url", &served.url(), "--token-file"])
        .arg(&wrong)
        .output()
        .expect("tokwatt runs");
    assert!(!output.status.success());
    let text = stderr(&output);
    assert!(
        text.contains(&format!(
            "401: the token in {} is not the agent's",
            wrong.display()
        )),
        "{text}"
    );
    let error = ApiClient::unix(&missing)
        .expect("client")
        .status()
        .expect_err("missing");
    assert!(matches!(error, ClientError::NoSocket { .. }), "{error}");
}

/// Issue 28: anyone who reaches the metrics port could hold it shut with idle or
/// one-byte-a-second connections, and the liveness probe reads it. With 1,000 such
/// clients on the metrics port and on the HTTP API, a scrape, a health check and a status
/// request are each answered (the idle ones make room; the header timeout, 10 s, is
/// longer than the answers take).
#[test]
fn a_thousand_idle_and_slow_clients_cannot_hold_a_listener_shut() {
    let served = Served::start();
    let metrics = served.server.metrics_addr().expect("metrics");
    let http = served.server.http_addr().expect("http");
    let mut held: Vec<std::net::TcpStream> = (0..1000)
        .map(|i| {
            let addr = if i % 2 == 0 { metrics } else { http };
            std::net::TcpStream::connect(addr).expect("connect")
        })
        .collect();
    for stream in held.iter_mut().step_by(3) {
        stream
            .write_all(b"GET /metr")
            .expect("one byte, then silence");
    }
    let scrape = over_tcp(
        metrics,
        b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(scrape.status, 200, "{scrape:?}");
    assert!(
        scrape.body.contains("tokwatt_ticks_total 7"),
        "{}",
        scrape.body
    );
    let health = over_tcp(
        metrics,
        b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    );
    assert_eq!(health.status, 200, "{health:?}");
    let status = served.over_http(
        format!("GET /v1/status HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\nConnection: close\r\n\r\n")
            .as_bytes(),
    );
    assert_eq!(status.status, 200, "{status:?}");
    drop(held);
}

/// `status --watch`: a status every period, one JSON document a line with --json, and an
/// agent that does not answer said so at every look, not an end.
#[test]
fn tokwatt_status_watches_an_agent() {
    let served = Served::start();
    let output = tokwatt()
        .args(["status", "--watch", "100ms", "--count", "2", "--socket"])
        .arg(&served.socket)
        .output()
        .expect("tokwatt runs");
    assert!(output.status.success(), "{}", stderr(&output));
    let text = String::from_utf8_lossy(&output.stdout);
    assert_eq!(text.matches("(every 100ms)").count(), 2, "{text}");
    assert_eq!(text.matches("fake-policy (version").count(), 2, "{text}");

    let output = tokwatt()
        .args([
            "status", "--json", "--watch", "100ms", "--count", "3", "--socket",
        ])
        .arg(&served.socket)
        .output()
        .expect("tokwatt runs");
    assert!(output.status.success(), "{}", stderr(&output));
    let lines: Vec<NodeStatus> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|line| serde_json::from_str(line).expect("one status a line"))
        .collect();
    assert_eq!(lines.len(), 3);

    let gone = served.socket.with_extension("gone");
    let output = tokwatt()
        .args(["status", "--watch", "100ms", "--count", "2", "--socket"])
        .arg(&gone)
        .output()
        .expect("tokwatt runs");
    assert!(!output.status.success(), "the last look failed");
    assert_eq!(
        stderr(&output).matches("not answering").count(),
        2,
        "{}",
        stderr(&output)
    );
    // Faster than 10 a second is refused with the fix.
    let output = tokwatt()
        .args(["status", "--watch", "10ms", "--socket"])
        .arg(&served.socket)
        .output()
        .expect("tokwatt runs");
    assert!(!output.status.success());
    assert!(
        stderr(&output).contains("100ms or more"),
        "{}",
        stderr(&output)
    );
}
