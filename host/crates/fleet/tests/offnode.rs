//! The off-node fence with real parts: Debian's ClusterLabs fence agents (`fence_redfish`)
//! against a Redfish BMC emulated by sushy-tools on loopback (over https, its certificate
//! checked, behind a password), and a coordinator on a real etcd that powers a frozen
//! host off and frees its watts on the proof. Fake agents (shell scripts speaking the
//! fence agent API) cover what a real BMC cannot be made to do on cue: hang, or answer
//! while the node comes back.

use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use tokwatt_fleet::etcd::EtcdFleet;
use tokwatt_fleet::ledger::{Entry, Why};
use tokwatt_fleet::offnode::{
    AgentAction, OffNodeConfig, OffNodeConfigError, OffNodeError, OffNodeFence, power_off,
    run_agent,
};
use tokwatt_fleet::store::ProofSource;
use tokwatt_fleet::{
    Coordinator, CoordinatorConfig, DomainBudget, FleetStore, Ledger, MarginalAllocator,
    NodeBudget, NodeReport, NodeSession, Round,
};
use tokwatt_test_support::{EtcdCluster, FakeSystem, RedfishEmulator, fence_agent, free_port};

/// A folder of the test's own, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "tokwatt-offnode-{name}-{}-{}",
            std::process::id(),
            free_port()
        ));
        std::fs::create_dir_all(&dir).expect("a scratch folder");
        Self(dir)
    }

    fn file(&self, name: &str, text: &str) -> PathBuf {
        let path = self.0.join(name);
        std::fs::write(&path, text).expect("write");
        path
    }

    /// An executable script, run once with no input until the kernel lets it run (a
    /// file just written can be busy for a moment while another test thread forks).
    fn script(&self, name: &str, text: &str) -> PathBuf {
        use std::os::unix::fs::PermissionsExt;
        let path = self.file(name, text);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        let start = Instant::now();
        loop {
            match std::process::Command::new(&path)
                .stdin(std::process::Stdio::null())
                .output()
            {
                Err(e)
                    if e.raw_os_error() == Some(26) && start.elapsed() < Duration::from_secs(5) =>
                {
                    std::thread::sleep(Duration::from_millis(20));
                }
                _ => return path,
            }
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn config(text: &str) -> Result<OffNodeConfig, OffNodeConfigError> {
    OffNodeConfig::parse(text, "off-node.toml")
}

// --- The configuration -------------------------------------------------------------

#[test]
fn a_configuration_is_refused_naming_the_key_and_the_fix() {
    let scratch = Scratch::new("config");
    let password = scratch.file("bmc-password", "s3cret\n");
    let password = password.display();
    let agent = fake_agent(&scratch, "fence_fake", "exit 1");
    let agent = agent.display();
    let node = |body: &str| format!("[nodes.gpu-1]\nagent = \"{agent}\"\n{body}\n");
    let cases: Vec<(String, &[&str])> = vec![
        (
            format!(
                "{}[nodes.gpu-1.options]\npassword = \"hunter2\"\n",
                node("")
            ),
            &[
                "nodes.gpu-1.options.password",
                "password_file",
                "password_env",
            ],
        ),
        (
            format!("{}[nodes.gpu-1.options]\naction = \"reboot\"\n", node("")),
            &["nodes.gpu-1.options.action", "coordinator"],
        ),
        (
            format!("after_s = 5\n{}", node("")),
            &["after_s", "lease TTL", "raise after_s above lease_ttl_s"],
        ),
        (
            format!("lease_ttl_s = 30\n{}", node("after_s = 20")),
            &["nodes.gpu-1.after_s", "lease_ttl_s"],
        ),
        (
            node("agnet = \"fence_redfish\""),
            &["unknown field", "agnet"],
        ),
        (
            "[nodes.gpu-1]\nagent = \"fence_no_such_agent\"\n".to_owned(),
            &[
                "nodes.gpu-1.agent",
                "fence_no_such_agent",
                "apt-get install fence-agents",
            ],
        ),
        (
            node(&format!(
                "password_file = \"{password}\"\npassword_env = \"BMC_PASSWORD\""
            )),
            &[
                "nodes.gpu-1.password_file",
                "one of password_file and password_env",
            ],
        ),
        (
            node("password_file = \"/nonexistent/bmc-password\""),
            &[
                "nodes.gpu-1.password_file",
                "cannot be read",
                "/nonexistent/bmc-password",
            ],
        ),
        (
            node("password_env = \"TOKWATT_TEST_NO_SUCH_VARIABLE\""),
            &["nodes.gpu-1.password_env", "TOKWATT_TEST_NO_SUCH_VARIABLE"],
        ),
        (
            format!(
                "{}[nodes.gpu-1.options]\nip = \"10.0.0.1\\naction=reboot\"\n",
                node("")
            ),
            &["nodes.gpu-1.options.ip", "line break", "one line"],
        ),
        (
            format!("{}[nodes.gpu-1.options]\nip = [1, 2]\n", node("")),
            &["nodes.gpu-1.options.ip", "array"],
        ),
        (
            node("timeout_s = -1"),
            &["nodes.gpu-1.timeout_s", "above zero"],
        ),
        ("after_s = 20\n".to_owned(), &["nodes", "[nodes.<name>]"]),
    ];
    for (text, words) in cases {
        let error = config(&text).expect_err(&text).to_string();
        for word in words {
            assert!(
                error.contains(word),
                "{text}\nsaid: {error}\nmissing: {word}"
            );
        }
        assert!(
            !error.contains("hunter2"),
            "the secret is repeated: {error}"
        );
    }
}

#[test]
fn a_full_configuration_loads_with_each_nodes_overrides() {
    let scratch = Scratch::new("full");
    let password = scratch.file("bmc-password", "s3cret\n");
    let agent = fake_agent(&scratch, "fence_fake", "exit 1");
    let text = format!(
        r#"
lease_ttl_s = 10
after_s = 15
timeout_s = 60
retry_after_s = 30

[nodes.gpu-1]
agent = "{agent}"
password_file = "{password}"
[nodes.gpu-1.options]
ip = "10.0.0.11"
ipport = 443
username = "tokwatt-fence"
systems-uri = "/redfish/v1/Systems/1"
ssl-insecure = true
[nodes.gpu-1.env]
REQUESTS_CA_BUNDLE = "/etc/tokwatt/bmc-ca.pem"

[nodes.gpu-2]
agent = "{agent}"
password_env = "PATH"
after_s = 40
timeout_s = 20
"#,
        agent = agent.display(),
        password = password.display()
    );
    let config = config(&text).expect("loads");
    assert_eq!(config.lease_ttl, Duration::from_secs(10));
    let first = &config.nodes["gpu-1"];
    assert_eq!(first.after, Duration::from_secs(15));
    assert_eq!(first.timeout, Duration::from_secs(60));
    assert_eq!(first.retry_after, Duration::from_secs(30));
    assert_eq!(first.options["ipport"], "443");
    assert_eq!(first.options["ssl-insecure"], "1");
    assert_eq!(first.bmc_address(), "10.0.0.11:443");
    assert_eq!(first.proof_by(), "fence_fake 10.0.0.11:443");
    assert_eq!(first.agent, agent);
    let second = &config.nodes["gpu-2"];
    assert_eq!(second.after, Duration::from_secs(40));
    assert_eq!(second.timeout, Duration::from_secs(20));
    assert_eq!(second.retry_after, Duration::from_secs(30));
}

// --- The agent, faked --------------------------------------------------------------

/// A fake fence agent: reads its options from its standard input as the real ones do,
/// then runs `body` with `$action` set.
fn fake_agent(scratch: &Scratch, name: &str, body: &str) -> PathBuf {
    scratch.script(
        name,
        &format!(
            "#!/bin/sh\naction=\"\"\nwhile IFS= read -r line; do\n  case \"$line\" in action=*) action=\"${{line#action=}}\";; esac\n  echo \"$line\" >> \"$0.input\"\ndone\n{body}\n"
        ),
    )
}

fn one_node(agent: &Path, extra: &str) -> OffNodeConfig {
    config(&format!(
        "lease_ttl_s = 1\n[nodes.gpu-1]\nagent = \"{}\"\nafter_s = 1.5\n{extra}\n",
        agent.display()
    ))
    .expect("a configuration")
}

#[test]
fn the_password_goes_on_the_agents_standard_input_and_never_into_what_it_says() {
    let scratch = Scratch::new("stdin");
    let password = scratch.file("bmc-password", "correct horse\n");
    // It repeats everything it was given (as a verbose agent might) and its arguments.
    let agent = fake_agent(
        &scratch,
        "fence_echo",
        "cat \"$0.input\"; echo \"arguments: $#\"; exit 0",
    );
    let config = one_node(
        &agent,
        &format!(
            "password_file = \"{}\"\n[nodes.gpu-1.options]\nip = \"127.0.0.1\"\nplug = \"3\"",
            password.display()
        ),
    );
    let run = run_agent(
        &config.nodes["gpu-1"],
        AgentAction::Status,
        &AtomicBool::new(false),
    )
    .expect("runs");
    assert_eq!(run.exit_code, Some(0));
    assert!(run.output.contains("action=status"), "{}", run.output);
    assert!(run.output.contains("ip=127.0.0.1"), "{}", run.output);
    assert!(run.output.contains("plug=3"), "{}", run.output);
    assert!(run.output.contains("password=********"), "{}", run.output);
    assert!(!run.output.contains("correct horse"), "{}", run.output);
    assert!(run.output.contains("arguments: 0"), "{}", run.output);
    // What the agent read: the password, on its standard input.
    let input = std::fs::read_to_string(format!("{}.input", agent.display())).expect("input");
    assert!(input.contains("password=correct horse\n"), "{input}");
}

#[test]
fn an_agent_that_hangs_is_killed_at_its_timeout_and_proves_nothing() {
    let scratch = Scratch::new("hang");
    let agent = fake_agent(
        &scratch,
        "fence_hangs",
        "case \"$action\" in off) exec sleep 30;; esac; exit 1",
    );
    let config = one_node(&agent, "timeout_s = 1");
    let start = Instant::now();
    let error = power_off(&config.nodes["gpu-1"], &AtomicBool::new(false))
        .expect_err("a hung agent proves nothing");
    assert!(
        matches!(error, OffNodeError::TimedOut { action: "off", .. }),
        "{error}"
    );
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn an_off_that_does_not_read_back_off_proves_nothing() {
    let scratch = Scratch::new("still-on");
    // It says it powered the node off, but the status still reads ON.
    let agent = fake_agent(
        &scratch,
        "fence_liar",
        "case \"$action\" in off) echo 'Success: Powered OFF'; exit 0;; status) echo 'Status: ON'; exit 0;; esac; exit 1",
    );
    let config = one_node(&agent, "");
    let error = power_off(&config.nodes["gpu-1"], &AtomicBool::new(false))
        .expect_err("a node that reads ON is not proven");
    assert!(matches!(error, OffNodeError::NotOff { .. }), "{error}");
    assert!(error.to_string().contains("Status: ON"), "{error}");
}

// --- fence_redfish against an emulated BMC ------------------------------------------

const BMC_USER: &str = "tokwatt-fence";
const BMC_PASSWORD: &str = "bmc-secret-1";

/// `fence_redfish` for each `(node, system, password file)` on `emulator`, its
/// certificate checked against the emulator's CA.
fn redfish_config(
    emulator: &RedfishEmulator,
    nodes: &[(&str, &str, &Path)],
    extra: &str,
) -> String {
    let mut text =
        format!("lease_ttl_s = 1\nafter_s = 1.5\ntimeout_s = 45\nretry_after_s = 1\n{extra}\n");
    for (node, system, password) in nodes {
        text.push_str(&format!(
            "[nodes.{node}]\nagent = \"fence_redfish\"\npassword_file = \"{}\"\n\
             [nodes.{node}.options]\nip = \"127.0.0.1\"\nipport = {}\nusername = \"{BMC_USER}\"\n\
             systems-uri = \"{}\"\n[nodes.{node}.env]\nREQUESTS_CA_BUNDLE = \"{}\"\n",
            password.display(),
            emulator.port,
            emulator.system(system).systems_uri(),
            emulator.ca().display()
        ));
    }
    text
}

fn status(config: &OffNodeConfig, node: &str) -> tokwatt_fleet::offnode::AgentRun {
    run_agent(
        &config.nodes[node],
        AgentAction::Status,
        &AtomicBool::new(false),
    )
    .expect("the status runs")
}

#[test]
fn fence_redfish_powers_a_node_off_and_reads_it_back_off() {
    if fence_agent("fence_redfish").is_none() {
        return;
    }
    let Some(emulator) =
        RedfishEmulator::start(vec![FakeSystem::on("gpu-1", 1)], BMC_USER, BMC_PASSWORD)
    else {
        return;
    };
    let config = config(&redfish_config(
        &emulator,
        &[("gpu-1", "gpu-1", &emulator.password_file)],
        "",
    ))
    .expect("a configuration");
    let before = status(&config, "gpu-1");
    assert_eq!(
        before.exit_code,
        Some(0),
        "{}\n{}",
        before.output,
        emulator.log()
    );
    assert!(before.output.contains("Status: ON"), "{}", before.output);

    let off = power_off(&config.nodes["gpu-1"], &AtomicBool::new(false))
        .unwrap_or_else(|e| panic!("powered off: {e}\n{}", emulator.log()));
    assert_eq!(off.by, format!("fence_redfish 127.0.0.1:{}", emulator.port));
    assert!(off.detail.contains("Status: OFF"), "{}", off.detail);
    assert!(!off.detail.contains(BMC_PASSWORD), "{}", off.detail);
    let after = status(&config, "gpu-1");
    assert!(after.reads_off(), "{after:?}");
    // Off again: the agents' off is idempotent ("Already OFF"), so a retry is safe.
    power_off(&config.nodes["gpu-1"], &AtomicBool::new(false)).expect("off again");
}

#[test]
fn a_wrong_password_or_an_unreachable_bmc_fails_and_leaves_the_node_on() {
    if fence_agent("fence_redfish").is_none() {
        return;
    }
    let Some(emulator) =
        RedfishEmulator::start(vec![FakeSystem::on("gpu-1", 1)], BMC_USER, BMC_PASSWORD)
    else {
        return;
    };
    let scratch = Scratch::new("wrong");
    let wrong = scratch.file("wrong-password", "not-the-password\n");
    let text = redfish_config(
        &emulator,
        &[
            ("right", "gpu-1", &emulator.password_file),
            ("wrong", "gpu-1", &wrong),
        ],
        "",
    );
    let config = config(&text).expect("a configuration");
    let error = power_off(&config.nodes["wrong"], &AtomicBool::new(false))
        .expect_err("a wrong password powers nothing off");
    assert!(
        matches!(error, OffNodeError::Failed { action: "off", .. }),
        "{error}"
    );
    assert!(!error.to_string().contains("not-the-password"), "{error}");

    // Nothing listens on this port: the BMC is unreachable.
    let unreachable = OffNodeConfig::parse(
        &text.replace(
            &format!("ipport = {}", emulator.port),
            &format!("ipport = {}", free_port()),
        ),
        "unreachable.toml",
    )
    .expect("a configuration");
    let error = power_off(&unreachable.nodes["right"], &AtomicBool::new(false))
        .expect_err("an unreachable BMC powers nothing off");
    assert!(matches!(error, OffNodeError::Failed { .. }), "{error}");

    let still = status(&config, "right");
    assert!(still.output.contains("Status: ON"), "{still:?}");
}

// --- A coordinator on etcd ---------------------------------------------------------

const DOMAIN: &str = "rack-off";

/// Unfenced nodes whose board defaults are their reserve: a node powered off is charged
/// its reserve once proven, so its stranded watts fall to 0.
fn budget(nodes: &[&str]) -> DomainBudget {
    DomainBudget {
        domain: DOMAIN.into(),
        budget_w: 20_000.0,
        uncontrolled_w: 0.0,
        nodes: nodes
            .iter()
            .map(|n| NodeBudget {
                node: (*n).into(),
                reserve_w: 1000.0,
                max_w: 5600.0,
                priority: 0,
                fenced: false,
                default_w: Some(1000.0),
            })
            .collect(),
    }
}

fn report(caps_in_force_w: f64) -> NodeReport {
    NodeReport {
        acked_generation: 0,
        caps_in_force_w,
        draw_w: caps_in_force_w * 0.9,
        tokens_per_s: 1000.0,
        wants_more: false,
        requested_w: caps_in_force_w,
        fence: None,
        default_w: 0.0,
        boot: 0,
    }
}

fn coordinator(config: OffNodeConfig) -> Coordinator {
    Coordinator::new(
        CoordinatorConfig {
            domain: DOMAIN.into(),
            name: "coordinator-1".into(),
            ttl: Duration::from_secs(10),
        },
        Box::new(MarginalAllocator::default()),
    )
    .with_off_node(OffNodeFence::new(config))
}

/// One leader round: its ledger, and how long the round took.
fn round(coordinator: &mut Coordinator, store: &dyn FleetStore) -> (Ledger, Duration) {
    let start = Instant::now();
    match coordinator.round(store).expect("a round") {
        Round::Leader { ledger, .. } => (*ledger, start.elapsed()),
        Round::Follower => panic!("the only replica leads"),
    }
}

fn entry<'a>(ledger: &'a Ledger, node: &str) -> &'a Entry {
    ledger
        .entries
        .iter()
        .find(|e| e.node() == node)
        .expect("a budgeted node")
}

/// Joins `nodes` holding 3 kW each, runs a round so the leader writes their holds, then
/// makes each of `silent` leave (its record gone at once, its hold kept: a frozen host
/// as the coordinator sees it once its lease lapsed).
fn join_then_silence(
    store: &EtcdFleet,
    coordinator: &mut Coordinator,
    nodes: &[&str],
    silent: &[&str],
) -> Vec<(String, NodeSession)> {
    let sessions: Vec<(String, NodeSession)> = nodes
        .iter()
        .map(|n| {
            let session = store
                .join(DOMAIN, n, Duration::from_secs(60), &report(3000.0))
                .expect("joins");
            ((*n).to_owned(), session)
        })
        .collect();
    let (ledger, _) = round(coordinator, store);
    for node in nodes {
        assert!(entry(&ledger, node).live(), "{node} is live");
        assert!(
            entry(&ledger, node).charged_w >= 3000.0,
            "{node} is charged its caps"
        );
    }
    for (node, session) in &sessions {
        if silent.contains(&node.as_str()) {
            store.leave(session).expect("leaves");
        }
    }
    sessions
}

#[test]
fn a_frozen_host_is_powered_off_through_its_bmc_and_its_watts_freed_on_the_proof() {
    if fence_agent("fence_redfish").is_none() {
        return;
    }
    let Some(emulator) = RedfishEmulator::start(
        vec![
            FakeSystem::on("host-a", 1),
            FakeSystem::on("host-b", 2),
            FakeSystem::on("host-c", 3),
        ],
        BMC_USER,
        BMC_PASSWORD,
    ) else {
        return;
    };
    let Some(cluster) = EtcdCluster::start(1) else {
        return;
    };
    let scratch = Scratch::new("coordinator");
    let wrong = scratch.file("wrong-password", "not-the-password\n");
    // a: frozen, its BMC answers; b: frozen, its password in the file is wrong; c: live.
    let config = config(&redfish_config(
        &emulator,
        &[
            ("a", "host-a", &emulator.password_file),
            ("b", "host-b", &wrong),
            ("c", "host-c", &emulator.password_file),
        ],
        "",
    ))
    .expect("a configuration");
    // The same BMCs with the right password for each: to read their power states.
    let checks = OffNodeConfig::parse(
        &redfish_config(
            &emulator,
            &[
                ("a", "host-a", &emulator.password_file),
                ("b", "host-b", &emulator.password_file),
                ("c", "host-c", &emulator.password_file),
            ],
            "",
        ),
        "checks.toml",
    )
    .expect("a configuration");
    let store = EtcdFleet::connect(&cluster.endpoints(), Duration::from_secs(2)).expect("connects");
    store.put_budget(&budget(&["a", "b", "c"])).expect("budget");
    let mut coordinator = coordinator(config);
    let sessions = join_then_silence(&store, &mut coordinator, &["a", "b", "c"], &["a", "b"]);
    let c_session = &sessions[2].1;

    let start = Instant::now();
    let mut longest_round = Duration::ZERO;
    let mut rounds_while_running = 0;
    let mut silent_before_action = None;
    let ledger = loop {
        store
            .renew(c_session)
            .expect("renews")
            .expect("c stays live");
        let (ledger, took) = round(&mut coordinator, &store);
        longest_round = longest_round.max(took);
        let fence = coordinator.off_node().expect("configured");
        if !fence.running().is_empty() {
            rounds_while_running += 1;
            silent_before_action.get_or_insert(entry(&ledger, "a").silent_for);
        }
        let a = entry(&ledger, "a");
        if a.why == Why::Proven(ProofSource::OffNode) && fence.counts().failed >= 2 {
            break ledger;
        }
        assert!(
            start.elapsed() < Duration::from_secs(90),
            "a not proven off within 90 s: {a:?}\n{:?}\n{}",
            fence.counts(),
            emulator.log()
        );
        // Before the action: a silent node, charged its hold, not its reserve.
        if a.why == Why::SilentUnproven {
            assert!(a.stranded_w >= 2000.0, "{a:?}");
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let a = entry(&ledger, "a");
    let proof = a.proof.as_ref().expect("the proof a's charge rests on");
    assert_eq!(proof.proof.source, ProofSource::OffNode);
    assert_eq!(proof.proof.sum_w, 0.0);
    assert_eq!(
        proof.proof.by,
        format!("fence_redfish 127.0.0.1:{}", emulator.port)
    );
    assert!(
        proof.proof.detail.contains("Status: OFF"),
        "{}",
        proof.proof.detail
    );
    // Powered off: charged its reboot floor (its reserve here), nothing stranded.
    assert_eq!(a.charged_w, 1000.0);
    assert_eq!(a.stranded_w, 0.0);
    assert!(status(&checks, "a").reads_off());
    // Not before the node had been silent for after_s.
    let waited = silent_before_action
        .flatten()
        .expect("the action was seen running");
    assert!(waited >= Duration::from_millis(1500), "{waited:?}");

    // b: its agent failed (the wrong password) and was tried again; nothing proven.
    let b = entry(&ledger, "b");
    assert_eq!(b.why, Why::SilentUnproven, "{b:?}");
    assert!(b.stranded_w >= 2000.0, "{b:?}");
    assert!(
        b.proofs
            .iter()
            .all(|p| p.proof.source != ProofSource::OffNode),
        "{b:?}"
    );
    assert!(status(&checks, "b").output.contains("Status: ON"));
    // c: live all along, never touched.
    assert!(entry(&ledger, "c").live());
    assert!(status(&checks, "c").output.contains("Status: ON"));

    let counts = coordinator.off_node().expect("configured").counts();
    assert_eq!(counts.powered_off, 1, "{counts:?}");
    assert!(counts.failed >= 2, "{counts:?}");
    assert_eq!(counts.cancelled, 0, "{counts:?}");
    // The round never waited on an agent: rounds ran on while it worked.
    assert!(rounds_while_running >= 2, "{rounds_while_running}");
    assert!(longest_round < Duration::from_secs(3), "{longest_round:?}");

    // Another round: a stays proven and no second action starts for it.
    let started = counts.started;
    let (ledger, _) = round(&mut coordinator, &store);
    assert_eq!(entry(&ledger, "a").why, Why::Proven(ProofSource::OffNode));
    let after = coordinator.off_node().expect("configured").counts();
    assert!(
        after.started <= started + 1,
        "only b may be tried again: {after:?}"
    );
}

#[test]
fn a_node_that_reports_again_has_its_action_cancelled_and_nothing_written() {
    let scratch = Scratch::new("cancel");
    let pid_file = scratch.0.join("agent.pid");
    // An off that takes long: the agent writes its pid, then waits.
    let agent = fake_agent(
        &scratch,
        "fence_slow",
        &format!(
            "case \"$action\" in off) echo $$ > '{}'; exec sleep 60;; status) echo 'Status: OFF'; exit 2;; esac; exit 1",
            pid_file.display()
        ),
    );
    let Some(cluster) = EtcdCluster::start(1) else {
        return;
    };
    let config = config(&format!(
        "lease_ttl_s = 1\nafter_s = 1.5\ntimeout_s = 120\n[nodes.a]\nagent = \"{}\"\n",
        agent.display()
    ))
    .expect("a configuration");
    let store = EtcdFleet::connect(&cluster.endpoints(), Duration::from_secs(2)).expect("connects");
    store.put_budget(&budget(&["a"])).expect("budget");
    let mut coordinator = coordinator(config);
    join_then_silence(&store, &mut coordinator, &["a"], &["a"]);

    let start = Instant::now();
    while coordinator
        .off_node()
        .expect("configured")
        .running()
        .is_empty()
    {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no action started"
        );
        round(&mut coordinator, &store);
        std::thread::sleep(Duration::from_millis(200));
    }
    let start = Instant::now();
    let pid = loop {
        if let Ok(pid) = std::fs::read_to_string(&pid_file) {
            break pid.trim().to_owned();
        }
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the agent did not start"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(Path::new(&format!("/proc/{pid}")).exists());

    // The host was only slow: its agent joins again while the off runs.
    let _back = store
        .join(DOMAIN, "a", Duration::from_secs(60), &report(3000.0))
        .expect("joins again");
    let (ledger, _) = round(&mut coordinator, &store);
    assert!(entry(&ledger, "a").live());
    let fence = coordinator.off_node().expect("configured");
    assert!(fence.running().is_empty());
    assert_eq!(fence.counts().cancelled, 1, "{:?}", fence.counts());
    // The agent is killed, not left to power a live node off.
    let start = Instant::now();
    while Path::new(&format!("/proc/{pid}")).exists() {
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "the agent still runs"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    for _ in 0..5 {
        let (ledger, _) = round(&mut coordinator, &store);
        let a = entry(&ledger, "a");
        assert!(a.live());
        assert!(
            a.proofs
                .iter()
                .all(|p| p.proof.source != ProofSource::OffNode),
            "{a:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let counts = coordinator.off_node().expect("configured").counts();
    assert_eq!(
        (counts.started, counts.powered_off, counts.failed),
        (1, 0, 0),
        "{counts:?}"
    );
}
