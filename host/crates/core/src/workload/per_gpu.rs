//! Several one-GPU workloads as one: GPU `i` of the node is the `i`-th workload's only
//! GPU (its index 0, or the NVML index a CUDA decode runs on). `tokwatt serve` runs one
//! workload source per GPU this way: the CUDA decode on each GPU, or each GPU's serving
//! engine's metrics.

use super::{Workload, WorkloadError};
use crate::types::WorkloadWindow;

/// One source per GPU, in the node's GPU order.
pub struct PerGpu {
    /// Each source and the index it answers to.
    sources: Vec<(Box<dyn Workload>, u32)>,
    name: &'static str,
}

impl std::fmt::Debug for PerGpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PerGpu")
            .field("name", &self.name)
            .field("gpus", &self.sources.len())
            .finish()
    }
}

impl PerGpu {
    /// `sources[i]` serves the node's GPU `i`, answering to its own index `inner[i]`.
    /// The name is the first source's (they are all of one kind).
    pub fn new(sources: Vec<(Box<dyn Workload>, u32)>) -> Self {
        let name = sources.first().map_or("none", |(source, _)| source.name());
        Self { sources, name }
    }

    fn source(&self, gpu: u32) -> Result<&(Box<dyn Workload>, u32), WorkloadError> {
        self.sources
            .get(gpu as usize)
            .ok_or(WorkloadError::NoSuchGpu {
                index: gpu,
                count: self.sources.len() as u32,
            })
    }

    fn source_mut(&mut self, gpu: u32) -> Result<&mut (Box<dyn Workload>, u32), WorkloadError> {
        let count = self.sources.len() as u32;
        self.sources
            .get_mut(gpu as usize)
            .ok_or(WorkloadError::NoSuchGpu { index: gpu, count })
    }
}

impl Workload for PerGpu {
    fn name(&self) -> &'static str {
        self.name
    }

    fn batch_size_max(&self, gpu: u32) -> u32 {
        self.source(gpu)
            .map_or(1, |(source, inner)| source.batch_size_max(*inner))
    }

    fn batch_size(&self, gpu: u32) -> u32 {
        self.source(gpu)
            .map_or(1, |(source, inner)| source.batch_size(*inner))
    }

    fn set_batch_size(&mut self, gpu: u32, batch: u32) -> Result<(), WorkloadError> {
        let (source, inner) = self.source_mut(gpu)?;
        source.set_batch_size(*inner, batch)
    }

    fn token_budget_range(&self, gpu: u32) -> Option<(u32, u32)> {
        let (source, inner) = self.source(gpu).ok()?;
        source.token_budget_range(*inner)
    }

    fn token_budget(&self, gpu: u32) -> Option<u32> {
        let (source, inner) = self.source(gpu).ok()?;
        source.token_budget(*inner)
    }

    fn set_token_budget(&mut self, gpu: u32, tokens: u32) -> Result<(), WorkloadError> {
        let (source, inner) = self.source_mut(gpu)?;
        source.set_token_budget(*inner, tokens)
    }

    fn read_window(&mut self, gpu: u32) -> Result<WorkloadWindow, WorkloadError> {
        let (source, inner) = self.source_mut(gpu)?;
        source.read_window(*inner)
    }

    /// Only where every GPU's source reports it.
    fn reports_ttft(&self) -> bool {
        !self.sources.is_empty() && self.sources.iter().all(|(s, _)| s.reports_ttft())
    }

    fn reports_requests(&self) -> bool {
        !self.sources.is_empty() && self.sources.iter().all(|(s, _)| s.reports_requests())
    }

    fn take_finished_requests(&mut self, gpu: u32, into: &mut super::FinishedRequests) {
        if let Ok((source, inner)) = self.source_mut(gpu) {
            source.take_finished_requests(*inner, into);
        }
    }

    /// Every GPU's source is of one kind; the least any of them knows.
    fn work_waiting(&self) -> super::WorkWaiting {
        use super::WorkWaiting::{Always, Reported, Unknown};
        let kinds: Vec<_> = self.sources.iter().map(|(s, _)| s.work_waiting()).collect();
        if kinds.contains(&Unknown) {
            Unknown
        } else if !kinds.is_empty() && kinds.iter().all(|&k| k == Always) {
            Always
        } else {
            Reported
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-GPU source that answers only to `index` and reports `tokens` per window.
    struct Fixed {
        index: u32,
        tokens: u64,
        batch: u32,
    }

    impl Workload for Fixed {
        fn name(&self) -> &'static str {
            "fixed"
        }
        fn batch_size_max(&self, _gpu: u32) -> u32 {
            64
        }
        fn batch_size(&self, _gpu: u32) -> u32 {
            self.batch
        }
        fn set_batch_size(&mut self, gpu: u32, batch: u32) -> Result<(), WorkloadError> {
            if gpu != self.index {
                return Err(WorkloadError::NoSuchGpu {
                    index: gpu,
                    count: 1,
                });
            }
            self.batch = batch;
            Ok(())
        }
        fn read_window(&mut self, gpu: u32) -> Result<WorkloadWindow, WorkloadError> {
            if gpu != self.index {
                return Err(WorkloadError::NoSuchGpu {
                    index: gpu,
                    count: 1,
                });
            }
            Ok(WorkloadWindow {
                tokens: self.tokens,
                ..WorkloadWindow::default()
            })
        }
    }

    #[test]
    fn each_gpu_reaches_its_own_source_by_that_source_s_index() {
        let mut node = PerGpu::new(vec![
            (
                Box::new(Fixed {
                    index: 0,
                    tokens: 10,
                    batch: 1,
                }),
                0,
            ),
            (
                Box::new(Fixed {
                    index: 3,
                    tokens: 30,
                    batch: 1,
                }),
                3,
            ),
        ]);
        assert_eq!(node.read_window(0).expect("gpu 0").tokens, 10);
        assert_eq!(node.read_window(1).expect("gpu 1").tokens, 30);
        node.set_batch_size(1, 8).expect("batch on gpu 1");
        assert_eq!((node.batch_size(0), node.batch_size(1)), (1, 8));
        assert!(matches!(
            node.read_window(2),
            Err(WorkloadError::NoSuchGpu { index: 2, count: 2 })
        ));
        // A source without a token budget says so by its type, named.
        assert_eq!(node.token_budget_range(1), None);
        assert_eq!(node.token_budget(1), None);
        let refused = node.set_token_budget(1, 512).expect_err("no budget");
        assert!(
            matches!(
                refused,
                WorkloadError::NoTokenBudget {
                    workload: "fixed",
                    gpu: 3
                }
            ),
            "{refused}"
        );
        assert!(refused.to_string().contains("decodes only"), "{refused}");
    }
}
