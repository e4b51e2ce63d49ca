//! `tokwatt sim-driver`: a simulated node's driver file, where its GPUs' settings outlive
//! the agent (`tokwatt_sim::SimDriver`): what it holds, a simulated reboot, and the boot
//! unit that applies a reserve when the node boots.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::Serialize;

use tokwatt_sim::{DriverState, SimDriver};

#[derive(Debug, clap::Subcommand)]
pub enum SimDriverCommand {
    /// What the driver holds now, board by board, and the caps' sum. The driver has no
    /// lock (every change is one write), so a stopped agent never stalls it.
    Show {
        /// The simulated driver file.
        path: PathBuf,
        /// Print JSON: the boards' caps, clock locks and batches, and the caps' sum.
        #[arg(long)]
        json: bool,
    },
    /// Reboot the simulated node: every board back at its defaults (default cap, no
    /// clock lock, the workload's own batch), then the boot unit's reserve if one is
    /// enabled. The node's agent, if it is running, sees it at its next read.
    Reboot {
        /// The simulated driver file.
        path: PathBuf,
    },
    /// Enable the node's boot unit (it fits the caps within a reserve when the node
    /// boots), or disable it. The caps in force do not change until the next reboot.
    #[command(group(clap::ArgGroup::new("unit").required(true).args(["watts", "off"])))]
    BootReserve {
        /// The simulated driver file.
        path: PathBuf,
        /// The reserve, watts, summed over the node's boards.
        #[arg(long, value_name = "W", allow_negative_numbers = true)]
        watts: Option<f64>,
        /// Disable the boot unit: a reboot leaves the board defaults.
        #[arg(long)]
        off: bool,
    },
}

impl SimDriverCommand {
    /// Whether the command only reads and prints.
    pub fn only_prints(&self) -> bool {
        matches!(self, Self::Show { .. })
    }
}

pub fn sim_driver(command: &SimDriverCommand) -> Result<()> {
    match command {
        SimDriverCommand::Show { path, json } => {
            let state = SimDriver::at(path).read()?;
            if *json {
                println!(
                    "{}",
                    serde_json::to_string_pretty(&Shown::of(path, &state))?
                );
            } else {
                print!("{}", table(path, &state));
            }
        }
        SimDriverCommand::Reboot { path } => {
            let state = SimDriver::at(path)
                .reboot()
                .with_context(|| format!("rebooting the simulated node of {}", path.display()))?;
            println!(
                "rebooted (boot {}): every board back at its defaults ({} W, no clock lock, the workload's own batch)",
                state.boots, state.limits.power_cap_default_w
            );
            match state.boot_reserve_w {
                Some(reserve) => println!(
                    "the boot unit fitted the caps within {reserve} W: {} W in all{}",
                    state.power_cap_sum_w(),
                    if state.power_cap_sum_w() > reserve {
                        " (the boards' minimum caps: the reserve is below them)"
                    } else {
                        ""
                    }
                ),
                None => println!(
                    "no boot unit: the caps sum to {} W, the board defaults",
                    state.power_cap_sum_w()
                ),
            }
        }
        SimDriverCommand::BootReserve { path, watts, off } => {
            let reserve = if *off { None } else { *watts };
            let state = SimDriver::at(path).set_boot_reserve(reserve)?;
            match state.boot_reserve_w {
                Some(reserve) => {
                    println!(
                        "boot unit enabled: the next reboot fits the caps within {reserve} W (the caps in force stay until then)"
                    );
                    let floor = state.limits.power_cap_min_w * state.boards.len() as f64;
                    if reserve < floor {
                        eprintln!(
                            "tokwatt: {reserve} W is below the {} boards' minimum caps ({floor} W): a reboot holds each board at its minimum",
                            state.boards.len()
                        );
                    }
                }
                None => println!("boot unit disabled: a reboot leaves the board defaults"),
            }
        }
    }
    Ok(())
}

/// `show --json`: what the fault harness reads every second.
#[derive(Debug, Serialize)]
struct Shown<'a> {
    path: &'a Path,
    profile: &'a str,
    generation: u64,
    boots: u64,
    boot_reserve_w: Option<f64>,
    /// The caps in force, summed: the most the node's GPUs may draw now.
    power_cap_sum_w: f64,
    /// What a reboot without a boot unit leaves.
    power_cap_default_sum_w: f64,
    boards: Vec<ShownBoard>,
}

#[derive(Debug, Serialize)]
struct ShownBoard {
    index: usize,
    power_cap_w: f64,
    sm_clock_lock_mhz: Option<(u32, u32)>,
    mem_clock_lock_mhz: Option<(u32, u32)>,
    /// `null`: the workload's own initial batch.
    batch_size: Option<u32>,
}

impl<'a> Shown<'a> {
    fn of(path: &'a Path, state: &'a DriverState) -> Self {
        Self {
            path,
            profile: &state.profile,
            generation: state.generation,
            boots: state.boots,
            boot_reserve_w: state.boot_reserve_w,
            power_cap_sum_w: state.power_cap_sum_w(),
            power_cap_default_sum_w: state.power_cap_default_sum_w(),
            boards: state
                .boards
                .iter()
                .enumerate()
                .map(|(index, board)| ShownBoard {
                    index,
                    power_cap_w: board.power_cap_w,
                    sm_clock_lock_mhz: board.sm_clock_lock_mhz,
                    mem_clock_lock_mhz: board.mem_clock_lock_mhz,
                    batch_size: board.batch_size,
                })
                .collect(),
        }
    }
}

fn table(path: &Path, state: &DriverState) -> String {
    let lock = |lock: Option<(u32, u32)>| {
        lock.map_or_else(|| "-".to_owned(), |(lo, hi)| format!("{lo}-{hi}"))
    };
    let mut text = format!(
        "simulated driver {} ({}, {} boards of {}): generation {}, {} boots, boot unit {}\n",
        path.display(),
        state.profile,
        state.boards.len(),
        state.board_name,
        state.generation,
        state.boots,
        state
            .boot_reserve_w
            .map_or_else(|| "off".to_owned(), |w| format!("fits {w} W")),
    );
    text.push_str(&format!(
        "{:>5}  {:>9}  {:>13}  {:>13}  {:>6}\n",
        "board", "cap W", "SM lock MHz", "mem lock MHz", "batch"
    ));
    for (index, board) in state.boards.iter().enumerate() {
        text.push_str(&format!(
            "{index:>5}  {:>9.1}  {:>13}  {:>13}  {:>6}\n",
            board.power_cap_w,
            lock(board.sm_clock_lock_mhz),
            lock(board.mem_clock_lock_mhz),
            board
                .batch_size
                .map_or_else(|| "own".to_owned(), |b| b.to_string()),
        ));
    }
    text.push_str(&format!(
        "caps sum to {} W ({} W at the board defaults)\n",
        state.power_cap_sum_w(),
        state.power_cap_default_sum_w()
    ));
    text
}
