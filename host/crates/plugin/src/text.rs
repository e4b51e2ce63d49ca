//! Text a plugin wrote, made safe to show: one line, no control characters, bounded.
//!
//! A plugin's strings reach the operator's terminal and log files (an `init` error, a
//! log message, a panic message inside a trap, a refused restore, even the names of its
//! exports and imports inside a load error). Left raw, they could clear the screen, move
//! the cursor, forge log lines with a newline, or flood the terminal.

use std::fmt::Write as _;

/// The default bound on plugin text shown to the operator.
pub const PLUGIN_TEXT_MAX_BYTES: usize = 1024;

/// `text` with every control character escaped (`\n`, `\r`, `\t`, `\u{1b}`, …, and the
/// backslash itself so an escape cannot be forged), Unicode bidirectional and
/// line/paragraph separators escaped too, and at most `max_bytes` of the result kept
/// (cut on a character boundary, never inside an escape), followed by
/// `… (N bytes cut)` naming how much of the original was left out.
pub fn sanitize_text(text: &str, max_bytes: usize) -> String {
    let mut out = String::with_capacity(text.len().min(max_bytes) + 24);
    for (at, c) in text.char_indices() {
        let start = out.len();
        match c {
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\\' => out.push_str("\\\\"),
            c if needs_escape(c) => {
                let _ = write!(out, "\\u{{{:x}}}", u32::from(c));
            }
            c => out.push(c),
        }
        if out.len() > max_bytes {
            out.truncate(start);
            let cut = text.len() - at;
            let _ = write!(out, "… ({cut} bytes cut)");
            break;
        }
    }
    out
}

/// Control characters (C0, DEL, C1) and the format characters that reorder or break
/// lines on a terminal.
fn needs_escape(c: char) -> bool {
    c.is_control()
        || matches!(
            c,
            '\u{2028}' | '\u{2029}' | '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}'
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped_and_the_text_stays_on_one_line() {
        let hostile = "ok\u{1b}[2J\r\nERROR fake line\u{7}\u{9b}31m\\n\u{202e}";
        let shown = sanitize_text(hostile, 1024);
        assert_eq!(
            shown,
            "ok\\u{1b}[2J\\r\\nERROR fake line\\u{7}\\u{9b}31m\\\\n\\u{202e}"
        );
        assert!(!shown.chars().any(|c| c.is_control()), "{shown:?}");
    }

    #[test]
    fn plain_text_is_unchanged() {
        let text = "power cap 250 W → 300 W, ok: état";
        assert_eq!(sanitize_text(text, 1024), text);
    }

    #[test]
    fn long_text_is_cut_and_says_how_much() {
        let text = "x".repeat(1 << 20);
        let shown = sanitize_text(&text, 1024);
        assert!(shown.starts_with(&"x".repeat(1024)));
        assert!(
            shown.ends_with(&format!("… ({} bytes cut)", (1 << 20) - 1024)),
            "{shown}"
        );
        assert!(shown.len() < 1100);
    }

    #[test]
    fn a_cut_never_splits_a_character_or_an_escape() {
        let shown = sanitize_text("ab\u{1b}cd", 4);
        assert_eq!(shown, "ab… (3 bytes cut)");
        let shown = sanitize_text("aé", 2);
        assert_eq!(shown, "a… (2 bytes cut)");
        assert_eq!(sanitize_text("", 0), "");
    }
}
