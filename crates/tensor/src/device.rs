//! Where a tensor lives and its kernels run: the CPU, or one CUDA GPU.
//!
//! A run chooses its device at run time (`--device cpu|cuda|cuda:N`); one binary serves both,
//! because the CUDA libraries are loaded when a CUDA device is first used, never at link time.

use std::fmt;
use std::str::FromStr;

/// A device: the host's cores, or CUDA GPU number `n` (its ordinal among the visible GPUs).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Device {
    #[default]
    Cpu,
    Cuda(usize),
}

impl Device {
    pub fn is_cpu(self) -> bool {
        self == Device::Cpu
    }

    pub fn is_cuda(self) -> bool {
        matches!(self, Device::Cuda(_))
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

impl FromStr for Device {
    type Err = String;

    /// `cpu`, `cuda` (GPU 0) or `cuda:N`.
    fn from_str(text: &str) -> Result<Self, String> {
        let text = text.trim();
        match text {
            "cpu" => return Ok(Device::Cpu),
            "cuda" | "gpu" => return Ok(Device::Cuda(0)),
            _ => {}
        }
        let bad = || format!("unknown device '{text}': write cpu, cuda or cuda:N (N = 0, 1, …)");
        let n = text
            .strip_prefix("cuda:")
            .or_else(|| text.strip_prefix("gpu:"))
            .ok_or_else(bad)?;
        n.parse().map(Device::Cuda).map_err(|_| bad())
    }
}

impl serde::Serialize for Device {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for Device {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let text = String::deserialize(d)?;
        text.parse().map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print_back() {
        for (text, device) in [
            ("cpu", Device::Cpu),
            ("cuda", Device::Cuda(0)),
            ("cuda:0", Device::Cuda(0)),
            ("cuda:3", Device::Cuda(3)),
            ("gpu:1", Device::Cuda(1)),
        ] {
            assert_eq!(text.parse::<Device>().unwrap(), device, "{text}");
        }
        assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
        assert_eq!("cuda:2".parse::<Device>().unwrap().to_string(), "cuda:2");
        for bad in ["cuda:", "cuda:x", "tpu", "cuda:-1", ""] {
            let e = bad.parse::<Device>().unwrap_err();
            assert!(e.contains("cpu, cuda or cuda:N"), "{bad}: {e}");
        }
    }
}
