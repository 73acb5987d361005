//! The isolation protocol as the host decodes it, from a hostile worker: arbitrary bytes cut into
//! frames by `read_frame` (the length prefix) and each frame decoded by `decode_message`. No
//! panic, no allocation beyond the frame (libFuzzer's -rss_limit_mb), and what decodes is a fixed
//! point: encoding it again and decoding that gives the same frame (the host never acts on a
//! message it would itself describe differently).
#![no_main]

use devhost::driver::isolation::protocol::{self, Message};
use libfuzzer_sys::fuzz_target;

/// The frame `message` encodes to, without its length prefix.
fn encode(message: &Message) -> Vec<u8> {
    let frame = match message {
        Message::Hello { info, .. } => protocol::hello(info),
        Message::LoadFailed(text) => protocol::load_failed(text),
        Message::Reply { id, status, state } => protocol::reply(*id, *status, state),
        Message::Log { level, message } => protocol::log(*level, message),
        Message::Changed => protocol::changed(),
    };
    frame[4..].to_vec()
}

fuzz_target!(|data: &[u8]| {
    // The same bytes as one bare frame body, as the host's reader hands them over...
    check(data);
    // ...and as a stream cut into frames by their length prefixes.
    let mut stream = data;
    while let Ok(Some(body)) = protocol::read_frame(&mut stream) {
        check(&body);
    }
});

fn check(body: &[u8]) {
    let Ok(message) = protocol::decode_message(body) else { return };
    if let Message::Hello { version, .. } = &message
        && *version != protocol::VERSION
    {
        // A worker of another version: the host stops reading there and says so.
        return;
    }
    let once = encode(&message);
    let decoded = protocol::decode_message(&once).expect("an encoded message must decode");
    assert_eq!(encode(&decoded), once, "decoding is not a fixed point of encoding");
}
