//! The fence outside the agent's loop (issue 40): a fleet node whose agent stops running
//! is back at its reserve within the deadline it declares. On the simulator, whose
//! simulated driver keeps the caps outside the agent as a real driver does: `tokwatt serve`
//! in a power domain on a real etcd, granted more than its reserve, with `tokwatt fence`
//! beside it; the agent paused (SIGSTOP), killed (SIGKILL), and started on a config that
//! does not load; every time the driver's caps, summed, are at most the reserve within the
//! deadline. And systemd's side: an agent started under a `NOTIFY_SOCKET` sends `READY=1`
//! and `WATCHDOG=1`, and a watchdog fence without one is refused by name.

use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::{Duration, Instant};

use tokwatt_fleet::etcd::EtcdFleet;
use tokwatt_fleet::ledger::Why;
use tokwatt_fleet::{FenceKind, FleetStore, Ledger, ProofSource, boot_of};
use tokwatt_serve::fence::status::FenceStatus;
use tokwatt_sim::{GpuProfile, SimDriver};
use tokwatt_test_support::{EtcdCluster, wait_for};

use crate::support::*;

/// The node's reserve; its four simulated H200s default to 700 W each.
const RESERVE_W: f64 = 1000.0;
/// `tokwatt fence --stall` and `fleet.fence.restore_s`: the deadline is their sum.
const STALL_S: f64 = 2.0;
const RESTORE_S: f64 = 2.0;

/// Starts `tokwatt args…` with its standard error in `log`.
fn spawn(args: &[&str], log: &Path) -> Running {
    let log_file = std::fs::File::create(log).expect("log file");
    Running(
        tokwatt()
            .args(args)
            .env("TOKWATT_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log_file)
            .spawn()
            .expect("tokwatt starts"),
    )
}

fn caps_sum(driver: &Path) -> f64 {
    SimDriver::at(driver)
        .read()
        .expect("the driver file reads")
        .power_cap_sum_w()
}

/// Waits until the driver's caps sum to at most the reserve, sampling every 20 ms; the
/// time it took from `since`.
fn time_to_reserve(node: &Node, since: Instant, limit: Duration) -> Duration {
    let driver = &node.driver;
    loop {
        if caps_sum(driver) <= RESERVE_W + 1e-6 {
            return since.elapsed();
        }
        assert!(
            since.elapsed() < limit,
            "the caps sum to {} W, still above the {RESERVE_W} W reserve {:?} later\n{}",
            caps_sum(driver),
            since.elapsed(),
            node.logs()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Whether the caps stay above 2 kW (a grant, not the 1 kW reserve) for `window`: a
/// node just back from a lapsed lease may be cut to its reserve and granted again.
fn granted_for(driver: &Path, window: Duration) -> bool {
    let start = Instant::now();
    while start.elapsed() < window {
        if caps_sum(driver) <= 2000.0 {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

struct Node {
    dir: tempfile::TempDir,
    /// The fleet's etcd, where the fence writes its records.
    etcd: String,
    config: PathBuf,
    driver: PathBuf,
    heartbeat: PathBuf,
    status: PathBuf,
}

/// A four-GPU simulated node `n1` of the domain `rack-f` on `etcd`, whose policy asks
/// 700 W of every GPU, fenced by a heartbeat; its driver file created at the boards'
/// defaults (a node that booted without a boot unit: 2800 W).
fn node(etcd: &str) -> Node {
    let dir = tempdir();
    let spec = dir.path().join("greedy.toml");
    std::fs::write(
        &spec,
        "name = \"greedy\"\nplugin = \"policy_static.wasm\"\nknobs = [\"power-cap\"]\ntick_ms = 100\n[sandbox]\ndeadline_ms = 20\n[params]\npower_cap_w = \"700\"\n",
    )
    .expect("spec");
    let driver = dir.path().join("node/driver.json");
    let profile = GpuProfile::load("h200").expect("the h200 profile");
    SimDriver::open_for(&driver, &profile, 4).expect("the driver file");
    let heartbeat = dir.path().join("fence/heartbeat");
    let status = dir.path().join("fence/status.json");
    std::fs::create_dir_all(dir.path().join("fence")).expect("the shared folder");
    let config = dir.path().join("serve.toml");
    std::fs::write(
        &config,
        format!(
            "[policy]\nspec = \"{}\"\n[node]\nbackend = \"sim\"\nsim_gpus = 4\nsim_driver = \"{}\"\n[api]\nsocket = \"{}\"\n[output]\ndir = \"{}\"\n\
             [fleet]\netcd = [\"{etcd}\"]\ndomain = \"rack-f\"\nnode = \"n1\"\nreserve_w = {RESERVE_W}\nlease_ttl = \"4s\"\nmargin = \"2s\"\nreport_every = \"200ms\"\ntimeout = \"300ms\"\n\
             [fleet.fence]\nkind = \"heartbeat\"\nheartbeat = \"{}\"\nstatus = \"{}\"\nrestore_s = {RESTORE_S}\n",
            spec.display(),
            driver.display(),
            dir.path().join("tokwatt.sock").display(),
            dir.path().join("out").display(),
            heartbeat.display(),
            status.display(),
        ),
    )
    .expect("config");
    Node {
        dir,
        etcd: etcd.to_owned(),
        config,
        driver,
        heartbeat,
        status,
    }
}

impl Node {
    fn serve(&self, log: &str) -> Running {
        spawn(
            &["serve", "--config", &self.config.display().to_string()],
            &self.dir.path().join(log),
        )
    }

    fn fence(&self, log: &str) -> Running {
        spawn(
            &[
                "fence",
                "--reserve",
                &RESERVE_W.to_string(),
                "--heartbeat",
                &self.heartbeat.display().to_string(),
                "--stall",
                &format!("{STALL_S}s"),
                "--status",
                &self.status.display().to_string(),
                "--sim-driver",
                &self.driver.display().to_string(),
                "--etcd",
                &self.etcd,
                "--domain",
                "rack-f",
                "--node",
                "n1",
            ],
            &self.dir.path().join(log),
        )
    }

    fn log(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Every log of the node's processes, for a failure's message.
    fn logs(&self) -> String {
        let mut text = String::new();
        for entry in std::fs::read_dir(self.dir.path())
            .expect("the node's folder")
            .flatten()
        {
            let path = entry.path();
            if path.extension().is_some_and(|e| e == "log") {
                text += &format!(
                    "--- {}\n{}\n",
                    path.display(),
                    std::fs::read_to_string(&path).unwrap_or_default()
                );
            }
        }
        text
    }
}

/// The domain's budget (the node may hold up to its four boards' 2800 W; the budget
/// fits that even counted unfenced) and a coordinator replica for it.
fn domain(cluster: &EtcdCluster, dir: &Path) -> Running {
    let endpoint = cluster.endpoints()[0].clone();
    let budget = dir.join("budget.toml");
    std::fs::write(
        &budget,
        format!(
            "domain = \"rack-f\"\nbudget_w = 3000\nuncontrolled_w = 0\n[[nodes]]\nnode = \"n1\"\nreserve_w = {RESERVE_W}\nmax_w = 2800\n"
        ),
    )
    .expect("budget");
    let written = tokwatt()
        .args(["fleet", "budget", "--etcd", &endpoint, "--file"])
        .arg(&budget)
        .output()
        .expect("tokwatt fleet budget");
    assert!(written.status.success(), "{}", stderr(&written));
    spawn(
        &[
            "fleet",
            "coordinate",
            "--etcd",
            &endpoint,
            "--domain",
            "rack-f",
            "--ttl",
            "3s",
            "--period",
            "200ms",
        ],
        &dir.join("coordinator.log"),
    )
}

#[test]
fn a_paused_killed_or_failing_agent_is_back_at_its_reserve_within_its_fences_deadline() {
    let Some(cluster) = EtcdCluster::start(1) else {
        return;
    };
    let node = node(&cluster.endpoints()[0]);
    let _coordinator = domain(&cluster, node.dir.path());
    let deadline = Duration::from_secs_f64(STALL_S + RESTORE_S);
    assert_eq!(caps_sum(&node.driver), 2800.0, "the boards' defaults");

    let mut fence = node.fence("fence.log");
    let mut agent = node.serve("serve.log");
    // The start applies the reserve first (the fence would, a stall later, too).
    wait_for("the reserve at start", Duration::from_secs(60), || {
        agent.assert_alive("the agent", &node.log("serve.log"));
        caps_sum(&node.driver) <= RESERVE_W + 1e-6
    });
    // Granted more than the reserve, the fence declared (the heartbeat kind, the stall
    // plus restore_s) and watching a beating heartbeat.
    let store = EtcdFleet::connect(&cluster.endpoints(), Duration::from_secs(1)).expect("etcd");
    let fenced_and_granted = |what: &str, agent: &mut Running| {
        wait_for(what, Duration::from_secs(90), || {
            agent.assert_alive("the agent", &node.log("serve.log"));
            let declared = store
                .read_domain("rack-f")
                .ok()
                .flatten()
                .and_then(|v| v.nodes.into_iter().find(|n| n.node == "n1"))
                .and_then(|n| n.record)
                .and_then(|r| r.report.fence);
            let watching = FenceStatus::read(&node.status)
                .ok()
                .flatten()
                .is_some_and(|s| !s.holding);
            declared.is_some_and(|f| {
                f.kind == FenceKind::Heartbeat
                    && (f.deadline_s - deadline.as_secs_f64()).abs() < 1e-9
            }) && watching
                && granted_for(&node.driver, Duration::from_secs(1))
        });
    };
    fenced_and_granted("the grant in force, the fence declared", &mut agent);
    // The agent wrote down the reserve it applied at its start, with a lease of its own.
    let ledger = || {
        Ledger::from_view(
            store
                .read_domain("rack-f")
                .expect("read")
                .expect("the budget"),
        )
    };
    let start_record = ledger().entries[0]
        .proofs
        .iter()
        .find(|p| p.proof.source == ProofSource::Agent)
        .cloned()
        .expect("the agent's record of its start");
    assert!(
        start_record.proof.sum_w <= RESERVE_W + 1e-6,
        "{start_record:?}"
    );
    assert_eq!(start_record.proof.caps_w.len(), 4);

    // Paused: the fence brings the caps to the reserve within the deadline.
    assert!(caps_sum(&node.driver) > 2000.0, "granted when paused");
    let paused = Instant::now();
    agent.signal("STOP");
    let took = time_to_reserve(&node, paused, deadline);
    eprintln!("SIGSTOP: at the reserve {took:?} after the pause (deadline {deadline:?})");
    // The node's lease lapses: its watts are freed on the fence's record, written after
    // its last grant, not on the deadline it declared.
    wait_for(
        "the ledger to free the paused node on its fence's record",
        Duration::from_secs(20),
        || {
            let ledger = ledger();
            let n1 = &ledger.entries[0];
            n1.why == Why::Proven(ProofSource::Fence)
                && n1.proof.as_ref().is_some_and(|p| {
                    p.proof.sum_w <= RESERVE_W + 1e-6
                        && n1.hold.is_some_and(|h| p.mod_revision > h.mod_revision)
                })
        },
    );
    fence.assert_alive("the fence", &node.log("fence.log"));
    wait_for(
        "the fence's status to say it holds",
        Duration::from_secs(5),
        || {
            FenceStatus::read(&node.status)
                .ok()
                .flatten()
                .is_some_and(|s| s.holding)
        },
    );
    // Resumed: the agent runs again, the fence lets go, and the grant is in force again.
    agent.signal("CONT");
    fenced_and_granted("the grant again after the pause", &mut agent);

    // Killed: the same.
    assert!(caps_sum(&node.driver) > 2000.0, "granted when killed");
    let killed = Instant::now();
    agent.signal("KILL");
    let took = time_to_reserve(&node, killed, deadline);
    eprintln!("SIGKILL: at the reserve {took:?} after the kill (deadline {deadline:?})");
    let _ = agent.0.wait();

    // A pod that restarts: the node rebooted meanwhile (its board defaults, no boot
    // unit), a new fence starts, and the agent's config does not load, so it fails before
    // its first tick: the fence applies the reserve a stall after its own start.
    fence.signal("TERM");
    let _ = fence.0.wait();
    assert!(!node.status.exists(), "a stopped fence removes its status");
    SimDriver::at(&node.driver).reboot().expect("reboot");
    assert_eq!(caps_sum(&node.driver), 2800.0);
    let started = Instant::now();
    let _fence = node.fence("fence-2.log");
    std::fs::write(&node.config, "[policy\nspec = ").expect("a broken config");
    let mut broken = node.serve("serve-broken.log");
    let failed = broken.0.wait().expect("exits");
    assert!(
        !failed.success(),
        "a config that does not parse fails the start"
    );
    let took = time_to_reserve(&node, started, deadline);
    eprintln!(
        "a start that failed: at the reserve {took:?} after the fence started (deadline {deadline:?})"
    );
}

#[test]
fn a_start_in_a_power_domain_applies_the_reserve_before_a_spec_that_fails() {
    // No etcd: the node holds its configured reserve.
    let node = node("http://127.0.0.1:9");
    let text = std::fs::read_to_string(&node.config).expect("config");
    std::fs::write(
        &node.config,
        text.replace("greedy.toml", "no-such-spec.toml"),
    )
    .expect("config");
    assert_eq!(caps_sum(&node.driver), 2800.0);
    let output = tokwatt()
        .args(["serve", "--config"])
        .arg(&node.config)
        .output()
        .expect("tokwatt serve");
    let log = stderr(&output);
    assert!(!output.status.success(), "{log}");
    assert!(log.contains("no-such-spec"), "{log}");
    let sum = caps_sum(&node.driver);
    assert!(
        sum <= RESERVE_W + 1e-6,
        "{sum} W after a start that failed: {log}"
    );
}

#[test]
fn the_fence_once_applies_the_reserve_and_never_raises() {
    let node = node("http://127.0.0.1:9");
    let driver = node.driver.display().to_string();
    let once = |reserve: &str| {
        tokwatt()
            .args([
                "fence",
                "--once",
                "--reserve",
                reserve,
                "--sim-driver",
                &driver,
            ])
            .output()
            .expect("tokwatt fence --once")
    };
    let output = once("1000");
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(caps_sum(&node.driver) <= 1000.0 + 1e-6);
    let text = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        text.contains("2800 W") && text.contains("now 1000 W"),
        "{text}"
    );
    // A higher reserve raises nothing.
    let output = once("2000");
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(caps_sum(&node.driver) <= 1000.0 + 1e-6);
    assert!(String::from_utf8_lossy(&output.stdout).contains("nothing to lower"));
    // A reserve below the boards' lowest caps: each at its lowest, and an error.
    let output = once("100");
    assert!(!output.status.success());
    assert!(stderr(&output).contains("lowest"), "{}", stderr(&output));
}

/// The boot unit with the fleet's store (`tokwatt fence --once --etcd …`): it applies the
/// reserve, reads the caps back and writes its record of this boot, which proves a reboot
/// lands at the reserve. After a reboot without it, the node's new boot is unproven: a
/// node the budget calls fenced is charged its board defaults, whatever it claims.
#[test]
fn a_boot_unit_proves_itself_for_its_boot_and_a_reboot_without_it_is_charged_its_defaults() {
    let Some(cluster) = EtcdCluster::start(1) else {
        return;
    };
    let endpoint = cluster.endpoints()[0].clone();
    let node = node(&endpoint);
    let budget = node.dir.path().join("budget.toml");
    std::fs::write(
        &budget,
        format!(
            "domain = \"rack-f\"\nbudget_w = 3000\n[[nodes]]\nnode = \"n1\"\nreserve_w = {RESERVE_W}\nmax_w = 2800\nfenced = true\n"
        ),
    )
    .expect("budget");
    let written = tokwatt()
        .args(["fleet", "budget", "--etcd", &endpoint, "--file"])
        .arg(&budget)
        .output()
        .expect("tokwatt fleet budget");
    assert!(written.status.success(), "{}", stderr(&written));
    let store = EtcdFleet::connect(&cluster.endpoints(), Duration::from_secs(1)).expect("etcd");
    let ledger = || {
        Ledger::from_view(
            store
                .read_domain("rack-f")
                .expect("read")
                .expect("the budget"),
        )
    };
    // Before any record: the operator's `fenced = true` is a claim; charged the defaults.
    assert_eq!(ledger().entries[0].charged_w, 2800.0);

    let driver = node.driver.display().to_string();
    let boot_unit = tokwatt()
        .args([
            "fence",
            "--once",
            "--reserve",
            "1000",
            "--sim-driver",
            &driver,
            "--etcd",
            &endpoint,
            "--domain",
            "rack-f",
            "--node",
            "n1",
        ])
        .output()
        .expect("tokwatt fence --once");
    assert!(boot_unit.status.success(), "{}", stderr(&boot_unit));
    let said = String::from_utf8_lossy(&boot_unit.stdout).into_owned();
    assert!(said.contains("boot record"), "{said}");
    let canonical = std::fs::canonicalize(&node.driver).expect("the driver file");
    let first_boot = boot_of(&format!("sim-driver {} boot 0", canonical.display()));
    let proven = ledger();
    let record = proven.entries[0]
        .proofs
        .iter()
        .find(|p| p.proof.source == ProofSource::Boot)
        .cloned()
        .expect("the boot unit's record");
    assert_eq!(record.proof.boot, first_boot);
    assert!(record.proof.sum_w <= RESERVE_W + 1e-6);
    assert!(proven.entries[0].boot_proven);
    assert_eq!(proven.entries[0].charged_w, RESERVE_W);

    // The node reboots without the unit: its defaults are in force, and its agent
    // reports the new boot, which no record proves.
    SimDriver::at(&node.driver).reboot().expect("reboot");
    assert_eq!(caps_sum(&node.driver), 2800.0);
    let second_boot = boot_of(&format!("sim-driver {} boot 1", canonical.display()));
    let session = store
        .join(
            "rack-f",
            "n1",
            Duration::from_secs(30),
            &tokwatt_fleet::NodeReport {
                acked_generation: 0,
                caps_in_force_w: 1000.0,
                draw_w: 0.0,
                tokens_per_s: 0.0,
                wants_more: false,
                requested_w: 0.0,
                fence: Some(tokwatt_fleet::Fence {
                    kind: FenceKind::Heartbeat,
                    deadline_s: 4.0,
                    covers_reboot: true,
                }),
                default_w: 2800.0,
                boot: second_boot,
            },
        )
        .expect("joins");
    let rebooted = ledger();
    assert!(!rebooted.entries[0].boot_proven);
    assert_eq!(rebooted.entries[0].charged_w, 2800.0);
    assert_eq!(rebooted.fence_missing(), ["n1"]);
    store.leave(&session).expect("leaves");
}

#[test]
fn an_agent_under_systemd_says_ready_and_feeds_the_watchdog() {
    let dir = tempdir();
    let socket = dir.path().join("notify.sock");
    let systemd = UnixDatagram::bind(&socket).expect("bind the notification socket");
    let config = dir.path().join("serve.toml");
    std::fs::write(
        &config,
        format!(
            "[policy]\nspec = \"{}\"\n[node]\nbackend = \"sim\"\nsim_gpus = 1\ntick = \"200ms\"\n[api]\nsocket = \"{}\"\n[output]\ndir = \"{}\"\n",
            repo_root().join("policies/slo-batch.toml").display(),
            dir.path().join("tokwatt.sock").display(),
            dir.path().join("out").display()
        ),
    )
    .expect("config");
    let log = dir.path().join("serve.log");
    let mut agent = Running(
        tokwatt()
            .args(["serve", "--quiet", "--duration", "3s", "--config"])
            .arg(&config)
            .env("NOTIFY_SOCKET", &socket)
            .env("WATCHDOG_USEC", "2000000")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).expect("log"))
            .spawn()
            .expect("tokwatt serve starts"),
    );
    systemd
        .set_read_timeout(Some(Duration::from_millis(500)))
        .expect("timeout");
    let mut messages = Vec::new();
    let mut buffer = [0_u8; 256];
    let started = Instant::now();
    while !messages.iter().any(|m| m == "STOPPING=1") {
        match systemd.recv(&mut buffer) {
            Ok(n) => messages.push(String::from_utf8_lossy(&buffer[..n]).into_owned()),
            Err(_) if started.elapsed() < Duration::from_secs(120) => {
                agent.assert_alive("the agent", &log);
            }
            Err(error) => panic!("no STOPPING=1 in 120 s ({error}): {messages:?}"),
        }
    }
    let ready = messages.iter().position(|m| m == "READY=1");
    let pings = messages.iter().filter(|m| *m == "WATCHDOG=1").count();
    // Ticks of 200 ms for 3 s, each on time: one ping a tick.
    assert!(ready.is_some(), "{messages:?}");
    assert!((8..=20).contains(&pings), "{pings} pings: {messages:?}");
    let status = agent.0.wait().expect("exits");
    assert!(status.success(), "the agent ended cleanly");
}

#[test]
fn a_watchdog_fence_outside_systemd_is_refused_naming_the_unit_settings() {
    let node = node("http://127.0.0.1:9");
    let text = std::fs::read_to_string(&node.config).expect("config");
    let fence_at = text.find("[fleet.fence]").expect("a fence table");
    std::fs::write(
        &node.config,
        format!(
            "{}[fleet.fence]\nkind = \"systemd-watchdog\"\n",
            &text[..fence_at]
        ),
    )
    .expect("config");
    let output = tokwatt()
        .args(["serve", "--config"])
        .arg(&node.config)
        .env_remove("NOTIFY_SOCKET")
        .env_remove("WATCHDOG_USEC")
        .output()
        .expect("tokwatt serve");
    let log = stderr(&output);
    assert!(!output.status.success(), "{log}");
    assert!(
        log.contains("NOTIFY_SOCKET")
            && log.contains("Type=notify")
            && log.contains("WatchdogSec="),
        "{log}"
    );
    // The reserve was applied before the refusal, as every start in a domain does.
    assert!(caps_sum(&node.driver) <= RESERVE_W + 1e-6);
}
