//! The host's default preferred allocation, called directly: how long
//! `devhost::engine::preferred::choose` takes as the candidate list grows, and how
//! often its greedy search (used above 20,000 combinations) finds a set as
//! good as a brute-force search written here, on random instances.

use crate::stats::Samples;
use devhost::engine::preferred::{Candidate, choose};
use std::collections::HashMap;
use std::time::Instant;

/// A preferred-allocation question, with link scores keyed by candidate index.
pub struct Instance {
    pub ids: Vec<String>,
    pub numa: Vec<Option<i64>>,
    /// Directed scores as drivers report them: (from, to) → score.
    pub links: HashMap<(usize, usize), u32>,
    pub must: Vec<usize>,
    pub size: usize,
}

impl Instance {
    /// Devices in link groups of 8 (40 within a pair, 20 within a quad, 10
    /// within the group), each group on one of two NUMA nodes: the bench
    /// driver's topology.
    pub fn grouped(n: usize, size: usize) -> Instance {
        let mut links = HashMap::new();
        for a in 0..n {
            for b in a / 8 * 8..(a / 8 * 8 + 8).min(n) {
                let s = if a == b {
                    0
                } else if a / 2 == b / 2 {
                    40
                } else if a / 4 == b / 4 {
                    20
                } else {
                    10
                };
                if s > 0 {
                    links.insert((a, b), s);
                }
            }
        }
        Instance {
            ids: (0..n).map(|i| format!("b-{i}")).collect(),
            numa: (0..n).map(|i| Some((i / 8 % 2) as i64)).collect(),
            links,
            must: Vec::new(),
            size,
        }
    }

    /// Runs the host's policy the way the endpoint calls it: link scores as
    /// edges between candidate indices.
    pub fn choose(&self) -> Vec<String> {
        let edges: Vec<(usize, usize, u32)> = self.links.iter().map(|(&(a, b), &s)| (a, b, s)).collect();
        let cands = self.ids.iter().enumerate().map(|(i, id)| Candidate { id, numa: self.numa[i], order: i }).collect();
        let must: Vec<String> = self.must.iter().map(|&i| self.ids[i].clone()).collect();
        choose(cands, &must, self.size, &edges)
    }

    fn pair(&self, a: usize, b: usize) -> u64 {
        u64::from(self.links.get(&(a, b)).copied().unwrap_or(0))
            + u64::from(self.links.get(&(b, a)).copied().unwrap_or(0))
    }

    /// (NUMA nodes used, total link score) of a set: what the policy ranks by
    /// before the stable order.
    pub fn quality(&self, set: &[usize]) -> (usize, u64) {
        let mut numas: Vec<Option<i64>> = set.iter().map(|&i| self.numa[i]).collect();
        numas.sort_unstable();
        numas.dedup();
        let mut links = 0;
        for (x, &a) in set.iter().enumerate() {
            for &b in &set[x + 1..] {
                links += self.pair(a, b);
            }
        }
        (numas.len(), links)
    }

    /// The best set by brute force: fewest NUMA nodes, then highest link
    /// score, then the earliest indices.
    pub fn brute_force(&self) -> Vec<usize> {
        let free: Vec<usize> = (0..self.ids.len()).filter(|i| !self.must.contains(i)).collect();
        let need = self.size - self.must.len();
        let mut best: Option<Best> = None;
        let mut pick = Vec::with_capacity(need);
        self.walk(&free, need, 0, &mut pick, &mut best);
        best.map(|(_, s)| s).unwrap_or_default()
    }

    fn walk(&self, free: &[usize], need: usize, start: usize, pick: &mut Vec<usize>, best: &mut Option<Best>) {
        if pick.len() == need {
            let mut set: Vec<usize> = self.must.iter().chain(pick.iter()).copied().collect();
            set.sort_unstable();
            let (numa, links) = self.quality(&set);
            let key = (numa, std::cmp::Reverse(links), set.clone());
            if best.as_ref().is_none_or(|(b, _)| key < *b) {
                *best = Some((key, set));
            }
            return;
        }
        for i in start..free.len() {
            if free.len() - i < need - pick.len() {
                break;
            }
            pick.push(free[i]);
            self.walk(free, need, i + 1, pick, best);
            pick.pop();
        }
    }

    pub fn indices(&self, ids: &[String]) -> Vec<usize> {
        let mut v: Vec<usize> = ids.iter().filter_map(|id| self.ids.iter().position(|x| x == id)).collect();
        v.sort_unstable();
        v
    }
}

/// The best set so far with its sort key (NUMA nodes, links, indices).
type Best = ((usize, std::cmp::Reverse<u64>, Vec<usize>), Vec<usize>);

/// xorshift64*: reproducible random instances without a dependency.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: usize, hi: usize) -> usize {
        lo + (self.next_u64() % (hi - lo + 1) as u64) as usize
    }
}

/// C(n, k).
pub fn binomial(n: usize, k: usize) -> u128 {
    (0..k).fold(1u128, |acc, i| acc * (n - i) as u128 / (i as u128 + 1))
}

/// A random instance whose combination count falls in `combos`.
pub fn random_instance(rng: &mut Rng, combos: std::ops::RangeInclusive<u128>) -> Instance {
    loop {
        let n = rng.range(6, 26);
        let size = rng.range(2, 8.min(n - 1));
        let must = if rng.range(0, 3) == 0 { 1 } else { 0 };
        if !combos.contains(&binomial(n - must, size - must)) {
            continue;
        }
        let nodes = rng.range(1, 3);
        let numa = (0..n).map(|_| Some(rng.range(0, nodes - 1) as i64)).collect();
        let mut links = HashMap::new();
        let density = rng.range(10, 60);
        for a in 0..n {
            for b in 0..n {
                if a != b && rng.range(0, 99) < density {
                    links.insert((a, b), rng.range(1, 50) as u32);
                }
            }
        }
        let must = (0..must).map(|_| rng.range(0, n - 1)).collect();
        return Instance { ids: (0..n).map(|i| format!("d{i}")).collect(), numa, links, must, size };
    }
}

/// Outcome of comparing the policy with brute force on random instances.
pub struct Agreement {
    pub instances: usize,
    /// Same NUMA count and link score as the optimum.
    pub same_quality: usize,
    /// Exactly the optimum's devices.
    pub same_set: usize,
}

/// Compares `choose` with brute force on `count` random instances in `combos`.
pub fn agreement(seed: u64, count: usize, combos: std::ops::RangeInclusive<u128>) -> Agreement {
    let mut rng = Rng::new(seed);
    let mut a = Agreement { instances: count, same_quality: 0, same_set: 0 };
    for _ in 0..count {
        let inst = random_instance(&mut rng, combos.clone());
        let got = inst.indices(&inst.choose());
        let best = inst.brute_force();
        if inst.quality(&got) == inst.quality(&best) {
            a.same_quality += 1;
        }
        if got == best {
            a.same_set += 1;
        }
    }
    a
}

/// Times `choose` on the grouped topology: `reps` calls, or fewer when one
/// call passes `budget`.
pub fn time_choose(n: usize, size: usize, reps: usize, budget: std::time::Duration) -> (Samples, Vec<String>) {
    let inst = Instance::grouped(n, size);
    let mut s = Samples::default();
    let mut answer = Vec::new();
    let start = Instant::now();
    for _ in 0..reps {
        let t = Instant::now();
        answer = inst.choose();
        s.push(t.elapsed());
        if start.elapsed() > budget {
            break;
        }
    }
    (s, answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn brute_force_prefers_one_node_then_links() {
        // Devices 0..8 in one group on node 0; 8..16 on node 1.
        let inst = Instance::grouped(16, 2);
        assert_eq!(inst.brute_force(), vec![0, 1]);
        assert_eq!(inst.quality(&[0, 1]), (1, 80));
        assert_eq!(inst.quality(&[0, 8]), (2, 0));
    }

    #[test]
    fn exhaustive_policy_matches_brute_force_on_small_instances() {
        let a = agreement(7, 20, 1..=2_000);
        assert_eq!(a.same_set, a.instances);
    }
}
