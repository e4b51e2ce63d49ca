//! The server alone, stepped by hand: how prompts share a step.

use super::*;
use tokwatt_core::workload::FinishedRequests;

fn server(budget: u32) -> Server {
    let scenario = Scenario::from_toml_str(
        &format!(
            "model = \"llama-3-8b\"\nprompt_tokens = 600\noutput_tokens = 50\n\
             max_batched_tokens = {budget}\n[[phases]]\nstart_s = 0\narrival_rps = 1.0\n"
        ),
        "test scenario",
    )
    .unwrap();
    let mut server = Server::new(&scenario, 1e9);
    server.rebalance(0.0, 64);
    server
}

/// Runs the server's own steps (10 ms each) until `t_end`, cutting every step into
/// `cuts` segments as arrivals and finishing sequences do; the first-token times.
fn first_tokens(server: &mut Server, cuts: u32, t_end: f64) -> Vec<f64> {
    let mut now = 0.0;
    while now < t_end {
        let Next::Steps { load, until_event } = server.next() else {
            break;
        };
        let steps = until_event.min(1.0 / f64::from(cuts)).max(1e-9);
        now += steps * 0.01;
        server.advance(&load, steps, 0.01, 0.0, now);
        server.rebalance(now, 64);
    }
    let mut records = FinishedRequests::default();
    server.take_finished(&mut records);
    let window = server.take_window();
    window.ttfts_ms
}

#[test]
fn prompts_a_step_holds_whole_get_their_first_tokens_together_after_one_step() {
    for cuts in [1, 3] {
        let mut server = server(8192);
        for _ in 0..3 {
            server.arrive(0.0, 600, 50);
        }
        server.rebalance(0.0, 64);
        let ttfts = first_tokens(&mut server, cuts, 0.05);
        // One step of 1,800 prompt tokens, however often events cut it: 10 ms each.
        assert_eq!(ttfts.len(), 3, "{ttfts:?}");
        for ttft in ttfts {
            assert!((ttft - 10.0).abs() < 1e-6, "cut {cuts}: {ttft}");
        }
    }
}

#[test]
fn a_prompt_longer_than_the_budget_ends_with_the_step_that_holds_its_last_chunk() {
    for cuts in [1, 3] {
        // 600 tokens under a budget of 256: chunks of 256, 256 and 88, three steps (not the
        // 2.34 a continuous flow would give), however often events cut them.
        let mut server = server(256);
        server.arrive(0.0, 600, 50);
        server.rebalance(0.0, 64);
        let ttfts = first_tokens(&mut server, cuts, 0.05);
        assert_eq!(ttfts.len(), 1);
        assert!((ttfts[0] - 30.0).abs() < 1e-6, "cut {cuts}: {ttfts:?}");
    }
}
