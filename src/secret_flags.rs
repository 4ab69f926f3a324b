//! Secrets given as command-line flags: visible to every local user, so each
//! use warns and names the file or environment variable to use instead.

/// Warns (stderr) that `flag` put a secret on the command line, where every local
/// user can read it (`ps`, `/proc/PID/cmdline`), and names the alternatives.
pub(crate) fn warn_secret_flag(flag: &str, instead: &str) {
    eprintln!(
        "tessera: warning: {flag} puts a secret on the command line, where every local \
         user can read it (ps, /proc/PID/cmdline); use {instead} instead"
    );
}

/// Whether `--flag` was given on the command line itself (not through its
/// environment variable).
pub(crate) fn on_command_line(flag: &str) -> bool {
    let eq = format!("{flag}=");
    std::env::args_os().any(|a| {
        let a = a.to_string_lossy();
        a == flag || a.starts_with(&eq)
    })
}
