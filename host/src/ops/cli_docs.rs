//! Documents generated from the command line's own definition: shell completion scripts
//! (`devhost completions SHELL`, through clap_complete) and the manual page (`devhost manpage`,
//! roff through clap_mangen), so neither can drift from the flags the binary accepts.

use std::io::Write;
use std::process::ExitCode;

/// Writes the completion script for `shell` to standard output.
pub fn completions(mut cmd: clap::Command, shell: clap_complete::Shell) -> ExitCode {
    let name = cmd.get_name().to_string();
    let mut out = Vec::new();
    clap_complete::generate(shell, &mut cmd, name, &mut out);
    emit(&out)
}

/// Writes the manual page: the command, then a section per subcommand with its own options.
pub fn manpage(cmd: clap::Command) -> ExitCode {
    let mut out = Vec::new();
    match render_manpage(cmd, &mut out) {
        Ok(()) => emit(&out),
        Err(e) => {
            eprintln!("devhost: cannot render the manual page: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The manual page in roff: clap_mangen's page of the whole command, followed by one section per
/// subcommand with its synopsis, description and options (clap_mangen's sections of the
/// subcommand, demoted to subsections).
pub fn render_manpage(cmd: clap::Command, out: &mut dyn Write) -> std::io::Result<()> {
    let mut cmd = cmd;
    cmd.build();
    let mut page = Vec::new();
    clap_mangen::Man::new(cmd.clone()).render(&mut page)?;
    // clap_mangen lists subcommands as pages of their own (`devhost-run(1)`); this page has no
    // such pages but a section per subcommand below, so the list names those sections.
    let prefix = format!("{}\\-", cmd.get_name());
    let mut in_list = false;
    for line in String::from_utf8_lossy(&page).lines() {
        if line.starts_with(".SH ") {
            in_list = line == ".SH SUBCOMMANDS";
        }
        match line.strip_prefix(&prefix).and_then(|rest| rest.strip_suffix("(1)")) {
            Some(sub) if in_list => {
                let full = format!("{} {sub}", cmd.get_name());
                writeln!(out, "{full} (see \\fB{}\\fR below)", full.to_uppercase())?;
            }
            _ => writeln!(out, "{line}")?,
        }
    }
    for sub in cmd.get_subcommands().filter(|s| s.get_name() != "help") {
        let full = format!("{} {}", cmd.get_name(), sub.get_name());
        writeln!(out, ".SH \"{}\"", full.to_uppercase())?;
        let man = clap_mangen::Man::new(sub.clone().bin_name(&full));
        let mut section = Vec::new();
        man.render_synopsis_section(&mut section)?;
        man.render_description_section(&mut section)?;
        if sub.get_arguments().any(|a| !a.is_hide_set()) {
            man.render_options_section(&mut section)?;
        }
        let text = String::from_utf8_lossy(&section);
        for line in text.lines() {
            match line.strip_prefix(".SH ") {
                Some(title) => writeln!(out, ".SS {title}")?,
                None => writeln!(out, "{line}")?,
            }
        }
    }
    Ok(())
}

fn emit(bytes: &[u8]) -> ExitCode {
    let mut stdout = std::io::stdout().lock();
    match stdout.write_all(bytes).and_then(|()| stdout.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        // A closed pipe (`| head`) is not worth a message.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("devhost: cannot write to standard output: {e}");
            ExitCode::FAILURE
        }
    }
}
