//! Files and directories that hold secrets (private keys, the admin token, the
//! tenancy store), created with their final modes from the start, and the mode
//! checks a process runs on the secrets it is given.
//!
//! Creating a file with the default mode and `chmod`ing it afterwards leaves a
//! window in which any local user can open it (and keep the descriptor); writing
//! through an existing path follows a planted symlink. So:
//!
//! - [`create_private_dir`]: missing directories are made `0700` (`mkdir` with the
//!   mode, not `chmod` after); an existing directory is left as it is.
//! - [`create_secret_file`]: a new file, `O_CREAT|O_EXCL` with mode `0600`; fails
//!   when anything (a file, a symlink) is already at the path.
//! - [`replace_file`]: writes a temporary file in the same directory the same way
//!   (with the mode asked for) and renames it over the path, so the path never
//!   holds a partial file and a symlink there is replaced, not followed.
//! - [`check_private_key_mode`], [`check_key_dir_mode`]: a key that group or others
//!   can read, or a directory of keys that they can write, is refused with the
//!   `chmod` that fixes it.
//!
//! The umask only clears bits, so these modes hold under any umask. On other
//! platforms than Unix the files are created plainly and the checks pass.

use std::io::Write;
use std::path::{Path, PathBuf};

/// Mode of secret files.
pub const SECRET_FILE_MODE: u32 = 0o600;
/// Mode of directories created for secrets.
pub const PRIVATE_DIR_MODE: u32 = 0o700;

/// Creates `dir` and any missing parents with mode `0700`. An existing directory
/// keeps its mode (the caller decides whether to check it).
///
/// Errors: the OS error of `mkdir`.
pub fn create_private_dir(dir: &Path) -> std::io::Result<()> {
    let mut b = std::fs::DirBuilder::new();
    b.recursive(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::DirBuilderExt;
        b.mode(PRIVATE_DIR_MODE);
    }
    b.create(dir)
}

fn open_new(path: &Path, mode: u32) -> std::io::Result<std::fs::File> {
    let mut o = std::fs::OpenOptions::new();
    o.write(true).create_new(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        o.mode(mode);
    }
    #[cfg(not(unix))]
    let _ = mode;
    o.open(path)
}

/// Creates the new file `path` with mode `0600` (`O_EXCL`: never an existing file,
/// never through a symlink) holding `contents`, flushed to disk.
///
/// Errors: `AlreadyExists` when anything is at `path`; other OS errors.
pub fn create_secret_file(path: &Path, contents: &[u8]) -> std::io::Result<()> {
    let mut f = open_new(path, SECRET_FILE_MODE)?;
    f.write_all(contents)?;
    f.sync_all()
}

/// Writes `contents` to a fresh temporary file next to `path` created with `mode`
/// (`O_EXCL`), then renames it over `path`: a reader sees the old file or the whole
/// new one, and a symlink at `path` is replaced rather than written through.
///
/// Errors: OS errors; the temporary file is removed when the rename fails.
pub fn replace_file(path: &Path, contents: &[u8], mode: u32) -> std::io::Result<()> {
    let tmp = temp_path(path);
    let written = open_new(&tmp, mode).and_then(|mut f| {
        f.write_all(contents)?;
        f.sync_all()
    });
    let renamed = written.and_then(|()| std::fs::rename(&tmp, path));
    if renamed.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    renamed
}

/// `DIR/.NAME.tmp-PID-NANOS`: unique enough for one writer; `O_EXCL` catches the rest.
fn temp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(|| "secret".into(), |n| n.to_string_lossy().into_owned());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    path.with_file_name(format!(".{name}.tmp-{}-{nanos}", std::process::id()))
}

/// The permission bits of `path` (following symlinks); `None` off Unix.
fn mode_of(path: &Path) -> std::io::Result<Option<u32>> {
    let meta = std::fs::metadata(path)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        Ok(Some(meta.permissions().mode() & 0o7777))
    }
    #[cfg(not(unix))]
    {
        let _ = meta;
        Ok(None)
    }
}

/// Checks that no one but the owner can read or write the private key `path`; with
/// `group_read`, the group may read it (a Kubernetes Secret volume with `fsGroup`
/// makes every file `0440` to the pod's own group).
///
/// Errors: the reason, naming the mode and the `chmod` that fixes it (the caller adds
/// the path), or the OS error of `stat`.
pub fn check_private_key_mode(path: &Path, group_read: bool) -> Result<(), String> {
    let Some(mode) = mode_of(path).map_err(|e| e.to_string())? else {
        return Ok(());
    };
    let allowed = if group_read { 0o740 } else { 0o700 };
    if mode & 0o777 & !allowed != 0 {
        let who = if mode & 0o007 != 0 {
            "others"
        } else {
            "its group"
        };
        return Err(format!(
            "private key is open to {who} (mode {:04o}): any local user in reach could \
             read or replace it; run `chmod 600 {}`",
            mode & 0o777,
            path.display()
        ));
    }
    Ok(())
}

/// Checks a file holding a bearer token (an admin or metrics token): group or others
/// that can write it could replace the token, so that is refused. Returns whether
/// others can read it (the caller warns: a Kubernetes Secret volume's default mode
/// is `0644`, so a readable token is common and not refused).
///
/// Errors: the reason, naming the mode and the `chmod` that fixes it (the caller adds
/// the path), or the OS error of `stat`.
pub fn check_token_file_mode(path: &Path) -> Result<bool, String> {
    let Some(mode) = mode_of(path).map_err(|e| e.to_string())? else {
        return Ok(false);
    };
    if mode & 0o022 != 0 {
        return Err(format!(
            "token file is writable by group or others (mode {:04o}): they could replace \
             the token; run `chmod 600 {}`",
            mode & 0o777,
            path.display()
        ));
    }
    Ok(mode & 0o004 != 0)
}

/// Checks that group and others cannot write directory `dir` (they could swap the
/// keys and certificates in it). A sticky directory (`chmod +t`, as Kubernetes
/// mounts Secret volumes) passes: there no one can rename or remove another user's
/// files.
///
/// Errors: the reason, naming the mode and the `chmod` that fixes it, or the OS error
/// of `stat`.
pub fn check_key_dir_mode(dir: &Path) -> Result<(), String> {
    let Some(mode) = mode_of(dir).map_err(|e| e.to_string())? else {
        return Ok(());
    };
    if mode & 0o022 != 0 && mode & 0o1000 == 0 {
        return Err(format!(
            "directory of private keys is writable by group or others (mode {:04o}): they \
             could replace its keys and certificates; run `chmod 700 {}`",
            mode & 0o7777,
            dir.display()
        ));
    }
    Ok(())
}

#[cfg(all(test, unix))]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn mode(p: &Path) -> u32 {
        std::fs::symlink_metadata(p).unwrap().permissions().mode() & 0o7777
    }

    /// Under the usual umask (022) a plain create gives 0644 and 0755; the helpers
    /// give 0600 and 0700 without a chmod.
    #[test]
    fn secrets_are_created_owner_only_and_never_through_a_symlink() {
        let root = tempfile::tempdir().unwrap();
        let dir = root.path().join("a/b");
        create_private_dir(&dir).unwrap();
        assert_eq!(mode(&dir), 0o700);
        assert_eq!(mode(&root.path().join("a")), 0o700);
        // Existing: untouched, no error.
        create_private_dir(&dir).unwrap();

        let key = dir.join("k.key");
        create_secret_file(&key, b"secret").unwrap();
        assert_eq!(mode(&key), 0o600);
        assert_eq!(std::fs::read(&key).unwrap(), b"secret");
        let again = create_secret_file(&key, b"other").unwrap_err();
        assert_eq!(again.kind(), std::io::ErrorKind::AlreadyExists);
        assert_eq!(std::fs::read(&key).unwrap(), b"secret");

        // A planted symlink is neither followed by create nor by replace.
        let target = root.path().join("stolen");
        let link = dir.join("link.key");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        let e = create_secret_file(&link, b"s").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::AlreadyExists);
        replace_file(&link, b"s2", SECRET_FILE_MODE).unwrap();
        assert!(!target.exists(), "the write went through the symlink");
        assert_eq!(mode(&link), 0o600);
        assert_eq!(std::fs::read(&link).unwrap(), b"s2");
        // Replacing keeps no temporary file behind.
        replace_file(&key, b"new", SECRET_FILE_MODE).unwrap();
        assert_eq!(std::fs::read(&key).unwrap(), b"new");
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(names.len(), 2, "{names:?}");
    }

    #[test]
    fn token_files_others_can_write_are_refused_and_readable_ones_reported() {
        let root = tempfile::tempdir().unwrap();
        let t = root.path().join("admin-token");
        std::fs::write(&t, "t").unwrap();
        for (m, want) in [
            (0o600, Ok(false)),
            (0o400, Ok(false)),
            (0o640, Ok(false)),
            (0o644, Ok(true)),
            (0o620, Err(())),
            (0o602, Err(())),
            (0o666, Err(())),
        ] {
            std::fs::set_permissions(&t, std::fs::Permissions::from_mode(m)).unwrap();
            let r = check_token_file_mode(&t);
            assert_eq!(r.clone().map_err(|_| ()), want, "{m:o}: {r:?}");
            if let Err(e) = r {
                assert!(e.contains(&format!("chmod 600 {}", t.display())), "{e}");
            }
        }
    }

    #[test]
    fn key_and_directory_modes_are_checked_with_the_fix() {
        let root = tempfile::tempdir().unwrap();
        let key = root.path().join("k.key");
        std::fs::write(&key, "k").unwrap();
        let set = |p: &Path, m: u32| {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(m)).unwrap()
        };
        for (m, ok, group_ok) in [
            (0o600, true, true),
            (0o400, true, true),
            (0o640, false, true),
            (0o440, false, true),
            (0o644, false, false),
            (0o660, false, false),
            (0o604, false, false),
        ] {
            set(&key, m);
            let r = check_private_key_mode(&key, false);
            assert_eq!(r.is_ok(), ok, "{m:o}: {r:?}");
            assert_eq!(
                check_private_key_mode(&key, true).is_ok(),
                group_ok,
                "{m:o}"
            );
            if let Err(e) = r {
                assert!(e.contains(&format!("chmod 600 {}", key.display())), "{e}");
                assert!(e.contains(&format!("{m:04o}")), "{e}");
            }
        }
        let dir = root.path().join("d");
        std::fs::create_dir(&dir).unwrap();
        for (m, ok) in [
            (0o700, true),
            (0o755, true),
            (0o775, false),
            (0o777, false),
            (0o1777, true),
        ] {
            set(&dir, m);
            let r = check_key_dir_mode(&dir);
            assert_eq!(r.is_ok(), ok, "{m:o}: {r:?}");
            if let Err(e) = r {
                assert!(e.contains(&format!("chmod 700 {}", dir.display())), "{e}");
            }
        }
        set(&dir, 0o700);
    }
}
