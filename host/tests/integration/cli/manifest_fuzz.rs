//! A time-bounded mutation fuzzer for manifest parsing and validation:
//! no input may panic, and every error must name a line and column.
//! `DEVHOST_FUZZ_SECS` sets the budget (default 3 s; CI uses the default),
//! `DEVHOST_FUZZ_SEED` replays a run.

use devhost::manifest::Manifest;
use std::path::Path;
use std::time::{Duration, Instant};

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        // xorshift64*: small, deterministic, good enough to mutate text.
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
}

const TOKENS: &[&str] = &[
    "[",
    "]",
    "[[resource]]",
    "[driver.x]",
    "[driver.x.options]",
    "\"",
    "'",
    "=",
    "\n",
    "{",
    "}",
    ",",
    ".",
    "name = \"a.com/b\"",
    "driver = \"x\"",
    "match = { model = \"*\" }",
    "replicas = 3",
    "call_timeout = \"0s\"",
    "poll_interval = -1",
    "kubelet_dir = \"\"",
    "é",
    "\u{0}",
    "\u{feff}",
    "🦀",
    "1e400",
    "nan",
    "true",
    "name = \"kubernetes.io/x\"",
    "module = \"/\"",
    "options = { a = { b = [1, [2]] } }",
    "#",
    "\t",
    "\r\n",
];

fn corpus() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("config");
    let mut out: Vec<String> = std::fs::read_dir(&root)
        .unwrap()
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "toml"))
        .filter_map(|p| std::fs::read_to_string(p).ok())
        .collect();
    out.push("[[resource]]\nname = \"example.com/a\"\ndriver = \"d\"\nmatch = { id = \"x-*\" }\n".into());
    out
}

fn mutate(rng: &mut Rng, base: &str) -> String {
    let mut s: Vec<char> = base.chars().collect();
    for _ in 0..1 + rng.below(6) {
        let pos = rng.below(s.len() + 1);
        match rng.below(6) {
            0 if !s.is_empty() => {
                let end = (pos + rng.below(40)).min(s.len());
                s.drain(pos.min(end)..end);
            }
            1 => {
                let t = TOKENS[rng.below(TOKENS.len())];
                s.splice(pos..pos, t.chars());
            }
            2 if !s.is_empty() => {
                let i = rng.below(s.len());
                s[i] = char::from_u32((rng.next() % 0x3000) as u32).unwrap_or('?');
            }
            3 => s.truncate(pos),
            4 => {
                let long: String = std::iter::repeat_n('a', rng.below(300)).collect();
                s.splice(pos..pos, long.chars());
            }
            _ => {
                // Duplicate a line: duplicate keys and tables.
                let text: String = s.iter().collect();
                let lines: Vec<&str> = text.lines().collect();
                if !lines.is_empty() {
                    let l = lines[rng.below(lines.len())].to_string() + "\n";
                    s.splice(pos..pos, l.chars());
                }
            }
        }
    }
    s.into_iter().collect()
}

fn located(loc: &str) -> bool {
    let mut parts = loc.rsplitn(3, ':');
    let col = parts.next().unwrap_or("");
    let line = parts.next().unwrap_or("");
    !col.is_empty()
        && col.bytes().all(|b| b.is_ascii_digit())
        && !line.is_empty()
        && line.bytes().all(|b| b.is_ascii_digit())
}

#[test]
fn mutated_manifests_never_panic_and_every_error_names_a_line() {
    let secs: u64 = std::env::var("DEVHOST_FUZZ_SECS").ok().and_then(|v| v.parse().ok()).unwrap_or(3);
    let seed: u64 = std::env::var("DEVHOST_FUZZ_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos() as u64).unwrap_or(1) | 1
    });
    let mut rng = Rng(seed);
    let corpus = corpus();
    assert!(corpus.len() >= 2, "the config/ examples form the corpus");
    let deadline = Instant::now() + Duration::from_secs(secs);
    let (mut runs, mut rejected) = (0u64, 0u64);
    let path = Path::new("/fuzz/devhost.toml");
    while Instant::now() < deadline {
        let pick = rng.below(corpus.len());
        let input = mutate(&mut rng, &corpus[pick]);
        let result = std::panic::catch_unwind(|| Manifest::parse(&input, path, None));
        let Ok(result) = result else {
            panic!("Manifest::parse panicked (replay with DEVHOST_FUZZ_SEED={seed}); input:\n{input}");
        };
        if let Err(errors) = result {
            rejected += 1;
            assert!(!errors.0.is_empty(), "an Err with no diagnostics; input:\n{input}");
            for d in &errors.0 {
                assert!(located(&d.location), "diagnostic without line:col: {d} (seed {seed}); input:\n{input}");
            }
        }
        runs += 1;
    }
    eprintln!("manifest fuzz: {runs} inputs ({rejected} rejected) in {secs} s, seed {seed}");
    assert!(runs > 100 && rejected > 0, "the fuzzer must actually exercise the parser");
}
