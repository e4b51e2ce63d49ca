//! The serving loop end to end on a tiny model: requests arrive, are prefilled and decoded,
//! and each finishes with its TTFT and TPOT; the windows count every token once.

use super::*;
use crate::{CudaServe, CudaServeConfig};
use tokwatt_core::workload::serving::{Request, RequestSource};

/// Twenty requests at the start, then nothing.
struct Burst {
    sent: bool,
}

impl RequestSource for Burst {
    fn arrivals(&mut self, _from_s: f64, _to_s: f64) -> Vec<Request> {
        if std::mem::replace(&mut self.sent, true) {
            return Vec::new();
        }
        (0..20)
            .map(|i| Request {
                arrival_s: 0.0,
                prompt: 20 + 7 * i,
                output: 10,
            })
            .collect()
    }
}

#[test]
fn requests_are_served_each_with_its_ttft_and_tpot() {
    let _lock = gpu_lock();
    let config = CudaServeConfig {
        model: tiny_shape(128, 8, 2),
        context: 300,
        slots: 8,
        running_limit: 6,
        max_batched_tokens: 64,
        queue_max: 100,
        device: 0,
        gpu_index: 0,
        engine: EngineOptions::default(),
        requests: Box::new(Burst { sent: false }),
    };
    let mut serve = match CudaServe::new(config) {
        Ok(serve) => serve,
        Err(error) if no_cuda(&error) => {
            tokwatt_test_support::skip_gpu(format_args!("no CUDA driver: {error}"));
            return;
        }
        Err(error) => panic!("{error}"),
    };
    let mut records = Vec::new();
    let mut tokens = 0;
    let mut first_tokens = 0;
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while records.len() < 20 && std::time::Instant::now() < deadline {
        std::thread::sleep(std::time::Duration::from_millis(50));
        let window = serve.read_window(0).unwrap();
        tokens += window.tokens;
        first_tokens += window.requests.unwrap().first_tokens;
        // The running limit holds.
        assert!(window.active_sequences <= 6, "{window:?}");
        records.extend(serve.take_finished().0);
    }
    let window = serve.read_window(0).unwrap();
    tokens += window.tokens;
    first_tokens += window.requests.unwrap().first_tokens;
    assert_eq!(records.len(), 20, "not every request finished in time");
    assert_eq!(tokens, 200);
    assert_eq!(first_tokens, 20);
    for r in &records {
        assert!(r.ttft_ms > 0.0 && r.first_token_s <= r.finish_s, "{r:?}");
        assert!(r.tpot_ms.is_some_and(|t| t > 0.0), "{r:?}");
        assert_eq!(r.output, 10);
    }
    // A lowered limit is taken; a limit beyond the slots is refused.
    serve.set_batch_size(0, 2).unwrap();
    assert!(serve.set_batch_size(0, 9).is_err());
}
