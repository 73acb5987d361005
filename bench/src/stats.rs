//! Latency samples and their summary: medians and tails by nearest rank,
//! printed in the unit that keeps three significant digits readable.

use std::time::Duration;

/// Latencies of one measurement, in any order.
#[derive(Clone, Debug, Default)]
pub struct Samples(pub Vec<Duration>);

/// What a table shows of a sample set.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Summary {
    pub n: usize,
    pub p50: Duration,
    pub p99: Duration,
    pub min: Duration,
    pub max: Duration,
}

impl Samples {
    pub fn push(&mut self, d: Duration) {
        self.0.push(d);
    }

    pub fn extend(&mut self, other: Samples) {
        self.0.extend(other.0);
    }

    /// The summary, or `None` when nothing was measured.
    pub fn summary(&self) -> Option<Summary> {
        let mut v = self.0.clone();
        if v.is_empty() {
            return None;
        }
        v.sort_unstable();
        Some(Summary {
            n: v.len(),
            p50: percentile(&v, 50.0),
            p99: percentile(&v, 99.0),
            min: v[0],
            max: v[v.len() - 1],
        })
    }
}

/// Nearest-rank percentile of sorted, non-empty samples.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    let rank = (p / 100.0 * sorted.len() as f64).ceil() as usize;
    sorted[rank.clamp(1, sorted.len()) - 1]
}

/// `12.3 µs`, `4.56 ms`, `1.23 s`.
pub fn fmt_dur(d: Duration) -> String {
    let ns = d.as_nanos() as f64;
    let (v, unit) = if ns < 1e3 {
        (ns, "ns")
    } else if ns < 1e6 {
        (ns / 1e3, "µs")
    } else if ns < 1e9 {
        (ns / 1e6, "ms")
    } else {
        (ns / 1e9, "s")
    };
    if v >= 100.0 {
        format!("{v:.0} {unit}")
    } else if v >= 10.0 {
        format!("{v:.1} {unit}")
    } else {
        format!("{v:.2} {unit}")
    }
}

/// `a / b` as `1.23×`, or `–` when `b` is zero.
pub fn ratio(a: Duration, b: Duration) -> String {
    if b.is_zero() { "–".into() } else { format!("{:.2}×", a.as_secs_f64() / b.as_secs_f64()) }
}

/// `p50 / p99` of a summary.
pub fn p50_p99(s: &Summary) -> String {
    format!("{} / {}", fmt_dur(s.p50), fmt_dur(s.p99))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn us(v: u64) -> Duration {
        Duration::from_micros(v)
    }

    #[test]
    fn nearest_rank_percentiles() {
        let s = Samples((1..=100).rev().map(us).collect()).summary().unwrap();
        assert_eq!((s.p50, s.p99, s.min, s.max), (us(50), us(99), us(1), us(100)));
        let one = Samples(vec![us(7)]).summary().unwrap();
        assert_eq!((one.p50, one.p99), (us(7), us(7)));
        assert!(Samples::default().summary().is_none());
    }

    #[test]
    fn durations_keep_three_digits() {
        assert_eq!(fmt_dur(Duration::from_nanos(950)), "950 ns");
        assert_eq!(fmt_dur(us(61)), "61.0 µs");
        assert_eq!(fmt_dur(Duration::from_micros(4_560)), "4.56 ms");
        assert_eq!(ratio(us(72), us(60)), "1.20×");
    }
}
