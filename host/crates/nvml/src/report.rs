//! The `gpus` report: what each GPU is, what it allows, and whether tokwatt may change it.

use std::fmt;

use nvml_wrapper::enum_wrappers::device::Clock;

use super::{NvmlError, init, managed_gpu};
use tokwatt_core::privileges::Privileges;

/// A range of supported clocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct ClockRange {
    pub count: usize,
    pub min_mhz: u32,
    pub max_mhz: u32,
}

impl ClockRange {
    fn of(clocks: &[u32]) -> Option<Self> {
        Some(Self {
            count: clocks.len(),
            min_mhz: *clocks.iter().min()?,
            max_mhz: *clocks.iter().max()?,
        })
    }
}

/// One GPU as `tokwatt gpus` shows it. Values NVML does not report are `None`.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct GpuReport {
    /// NVML's index (as `nvidia-smi` numbers the GPUs).
    pub index: u32,
    pub name: String,
    pub uuid: String,
    /// The NVIDIA driver's version (system-wide, repeated per GPU), e.g. `580.159.04`.
    pub driver_version: Option<String>,
    /// The CUDA version the driver supports, e.g. `13.0`.
    pub cuda_driver_version: Option<String>,
    pub power_limit_min_w: f64,
    pub power_limit_max_w: f64,
    pub power_limit_default_w: f64,
    /// The limit requested through NVML now.
    pub power_limit_w: Option<f64>,
    /// The limit the GPU enforces now (lower when another limit wins).
    pub power_limit_enforced_w: Option<f64>,
    pub power_draw_w: Option<f64>,
    pub sm_clocks: Option<ClockRange>,
    pub mem_clocks: Option<ClockRange>,
    pub sm_clock_mhz: Option<u32>,
    pub mem_clock_mhz: Option<u32>,
    pub temperature_c: Option<u32>,
    /// Whether tokwatt, as it runs now, may change this GPU's settings.
    pub can_change_settings: bool,
    /// Why not, with the fix.
    pub cannot_change_because: Option<String>,
}

/// Read every GPU NVML sees. Reads only; changes nothing.
pub fn list_gpus() -> Result<Vec<GpuReport>, NvmlError> {
    let nvml = init()?;
    let count = nvml
        .device_count()
        .map_err(|e| NvmlError::Init(e.to_string()))?;
    let privileges = Privileges::current();
    // Measurements are only comparable on the same driver: every report names it.
    let driver_version = nvml.sys_driver_version().ok();
    let cuda_driver_version = nvml.sys_cuda_driver_version().ok().map(|v| {
        format!(
            "{}.{}",
            nvml_wrapper::cuda_driver_version_major(v),
            nvml_wrapper::cuda_driver_version_minor(v)
        )
    });
    let mut reports = Vec::with_capacity(count as usize);
    for index in 0..count {
        let managed = managed_gpu(&nvml, index, index)?;
        let device = nvml
            .device_by_index(index)
            .map_err(super::query_error(index, "the device handle"))?;
        let watts = |mw: u32| f64::from(mw) / 1000.0;
        let cannot_change_because = match privileges.denial() {
            Some(denial) => Some(denial.to_string()),
            None if !managed.power_cap_supported => {
                Some("NVML reports no power management on this GPU".into())
            }
            None => None,
        };
        let info = managed.info;
        reports.push(GpuReport {
            index,
            name: info.name,
            uuid: info.uuid,
            driver_version: driver_version.clone(),
            cuda_driver_version: cuda_driver_version.clone(),
            power_limit_min_w: info.power_cap_min_w,
            power_limit_max_w: info.power_cap_max_w,
            power_limit_default_w: info.power_cap_default_w,
            power_limit_w: device.power_management_limit().ok().map(watts),
            power_limit_enforced_w: device.enforced_power_limit().ok().map(watts),
            power_draw_w: device.power_usage().ok().map(watts),
            sm_clocks: ClockRange::of(&info.sm_clocks_mhz),
            mem_clocks: ClockRange::of(&info.mem_clocks_mhz),
            sm_clock_mhz: device.clock_info(Clock::SM).ok(),
            mem_clock_mhz: device.clock_info(Clock::Memory).ok(),
            temperature_c: device
                .temperature(nvml_wrapper::enum_wrappers::device::TemperatureSensor::Gpu)
                .ok(),
            can_change_settings: cannot_change_because.is_none(),
            cannot_change_because,
        });
    }
    Ok(reports)
}

/// The reports as a plain-text table, one GPU per block, for the terminal.
#[derive(Debug, Clone, Copy)]
pub struct GpuTable<'a>(pub &'a [GpuReport]);

impl fmt::Display for GpuTable<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return writeln!(f, "no NVIDIA GPU found");
        }
        let watts = |w: Option<f64>| w.map_or_else(|| "n/a".to_owned(), |w| format!("{w:.0} W"));
        let mhz = |m: Option<u32>| m.map_or_else(|| "n/a".to_owned(), |m| format!("{m} MHz"));
        let range = |r: Option<ClockRange>| {
            r.map_or_else(
                || "n/a".to_owned(),
                |r| format!("{}-{} MHz ({} steps)", r.min_mhz, r.max_mhz, r.count),
            )
        };
        for (n, gpu) in self.0.iter().enumerate() {
            if n > 0 {
                writeln!(f)?;
            }
            writeln!(f, "GPU {}  {}  {}", gpu.index, gpu.name, gpu.uuid)?;
            writeln!(
                f,
                "  driver        {}, CUDA {}",
                gpu.driver_version.as_deref().unwrap_or("n/a"),
                gpu.cuda_driver_version.as_deref().unwrap_or("n/a")
            )?;
            writeln!(
                f,
                "  power limit   {} (enforced {}), range {:.0}-{:.0} W, default {:.0} W",
                watts(gpu.power_limit_w),
                watts(gpu.power_limit_enforced_w),
                gpu.power_limit_min_w,
                gpu.power_limit_max_w,
                gpu.power_limit_default_w
            )?;
            writeln!(
                f,
                "  now           {} drawn, SM {}, memory {}, {}",
                watts(gpu.power_draw_w),
                mhz(gpu.sm_clock_mhz),
                mhz(gpu.mem_clock_mhz),
                gpu.temperature_c
                    .map_or_else(|| "n/a".to_owned(), |c| format!("{c} °C"))
            )?;
            writeln!(f, "  SM clocks     {}", range(gpu.sm_clocks))?;
            writeln!(f, "  memory clocks {}", range(gpu.mem_clocks))?;
            match &gpu.cannot_change_because {
                None => writeln!(f, "  settings      can be changed")?,
                Some(why) => writeln!(f, "  settings      read-only: {why}")?,
            }
        }
        Ok(())
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)] // tests may unwrap
mod tests {
    use super::*;

    fn report() -> GpuReport {
        GpuReport {
            index: 0,
            name: "NVIDIA H200".into(),
            uuid: "GPU-8f7d7400-cf3f-3d61-8883-624982a1b30e".into(),
            driver_version: Some("580.159.04".into()),
            cuda_driver_version: Some("13.0".into()),
            power_limit_min_w: 200.0,
            power_limit_max_w: 700.0,
            power_limit_default_w: 700.0,
            power_limit_w: Some(700.0),
            power_limit_enforced_w: Some(650.0),
            power_draw_w: Some(97.187),
            sm_clocks: ClockRange::of(&[1980, 1965, 345]),
            mem_clocks: ClockRange::of(&[3201, 2201]),
            sm_clock_mhz: Some(390),
            mem_clock_mhz: Some(3201),
            temperature_c: Some(37),
            can_change_settings: false,
            cannot_change_because: Some("running as uid 1000 without CAP_SYS_ADMIN".into()),
        }
    }

    #[test]
    fn table_shows_limits_clocks_and_why_settings_are_read_only() {
        let mut second = report();
        second.index = 1;
        second.power_limit_w = None;
        second.sm_clocks = None;
        second.can_change_settings = true;
        second.cannot_change_because = None;
        second.driver_version = None;
        second.cuda_driver_version = None;
        let text = GpuTable(&[report(), second]).to_string();
        assert!(text.contains("GPU 0  NVIDIA H200  GPU-8f7d7400"), "{text}");
        assert!(
            text.contains("driver        580.159.04, CUDA 13.0"),
            "{text}"
        );
        assert!(text.contains("driver        n/a, CUDA n/a"), "{text}");
        assert!(
            text.contains("700 W (enforced 650 W), range 200-700 W"),
            "{text}"
        );
        assert!(
            text.contains("97 W drawn, SM 390 MHz, memory 3201 MHz, 37 °C"),
            "{text}"
        );
        assert!(
            text.contains("SM clocks     345-1980 MHz (3 steps)"),
            "{text}"
        );
        assert!(
            text.contains("memory clocks 2201-3201 MHz (2 steps)"),
            "{text}"
        );
        assert!(text.contains("read-only: running as uid 1000"), "{text}");
        assert!(text.contains("n/a (enforced 650 W)"), "{text}");
        assert!(text.contains("settings      can be changed"), "{text}");
        assert_eq!(GpuTable(&[]).to_string(), "no NVIDIA GPU found\n");
    }

    #[test]
    fn report_serialises_for_json_output() {
        let json = serde_json::to_value(report()).unwrap();
        assert_eq!(json["power_limit_enforced_w"], 650.0);
        assert_eq!(json["sm_clocks"]["count"], 3);
        assert_eq!(json["can_change_settings"], false);
        assert_eq!(json["driver_version"], "580.159.04");
        assert_eq!(json["cuda_driver_version"], "13.0");
    }

    #[test]
    fn list_gpus_reports_every_gpu_or_skips() {
        match list_gpus() {
            Ok(reports) => {
                println!("{}", GpuTable(&reports));
                for (n, gpu) in reports.iter().enumerate() {
                    assert_eq!(gpu.index as usize, n);
                    assert!(gpu.uuid.starts_with("GPU-"), "{}", gpu.uuid);
                    assert!(gpu.driver_version.is_some(), "NVML names its driver");
                    assert!(gpu.power_limit_min_w <= gpu.power_limit_max_w);
                    assert_eq!(gpu.can_change_settings, gpu.cannot_change_because.is_none());
                }
            }
            Err(error) => {
                assert!(
                    error.means_no_driver(),
                    "NVML is installed but failed: {error}"
                );
                if let NvmlError::LibraryNotLoaded { .. } = error {
                    assert!(error.to_string().contains("libnvidia-ml.so.1"));
                }
                tokwatt_test_support::skip_gpu(format_args!("NVML not available: {error}"));
            }
        }
    }
}
