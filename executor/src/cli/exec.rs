//! `strata exec` (attached, with a pty or pipes) and `strata port`: byte
//! streams to a sandbox over the API socket.

use std::io::{IsTerminal, Read, Write};
use std::os::fd::AsFd;

use anyhow::{bail, Context, Result};
use clap::Args;

use super::{client, Cli};
use crate::client::ClientError;
use crate::stream::{self, FrameKind};
use crate::types::ExecRequestBody;

#[derive(Args, Debug)]
pub struct ExecArgs {
    pub id: String,
    /// Forward stdin.
    #[arg(short = 'i', long)]
    pub interactive: bool,
    /// Allocate a pseudo-terminal.
    #[arg(short = 't', long)]
    pub tty: bool,
    #[arg(long = "env", short = 'e')]
    pub env: Vec<String>,
    #[arg(long)]
    pub cwd: Option<String>,
    /// UID[:GID]
    #[arg(long, short = 'u')]
    pub user: Option<String>,
    /// Kill the command's process group after this many seconds.
    #[arg(long)]
    pub timeout: Option<f64>,
    #[arg(last = true, required = true)]
    pub cmd: Vec<String>,
}

pub(super) fn run_exec(cli: &Cli, a: &ExecArgs) -> Result<i32> {
    let tty = a.tty && std::io::stdin().is_terminal();
    let (rows, cols) = if tty { window_size() } else { (24, 80) };
    let body = ExecRequestBody {
        argv: a.cmd.clone(),
        env: a.env.clone(),
        cwd: a.cwd.clone(),
        user: a.user.clone(),
        timeout: a.timeout,
        stdin: None,
        tty: a.tty,
        rows: Some(rows),
        cols: Some(cols),
    };
    let att = match client(cli)?.attach(&format!("/v1/sandboxes/{}/exec", a.id), &body) {
        Ok(a) => a,
        Err(e @ ClientError::Api { .. }) => {
            eprintln!("strata: {e}");
            return Ok(if e.status() == Some(404) { 125 } else { 126 });
        }
        Err(e) => return Err(e.into()),
    };
    let _raw = if tty { Some(RawTerminal::enable()) } else { None };
    let mut input = att.writer;
    if a.interactive {
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            let mut stdin = std::io::stdin();
            loop {
                match stdin.read(&mut buf) {
                    Ok(0) | Err(_) => {
                        let _ = stream::write_frame(&mut input, FrameKind::Stdin, &[]);
                        return;
                    }
                    Ok(n) => {
                        if stream::write_frame(&mut input, FrameKind::Stdin, &buf[..n]).is_err() {
                            return;
                        }
                    }
                }
            }
        });
    } else {
        // The command may already have finished and the daemon closed the
        // connection: a failed write here is not an error, the exit frame is.
        let _ = stream::write_frame(&mut input, FrameKind::Stdin, &[]);
    }
    let mut reader = att.reader;
    let (mut out, mut err) = (std::io::stdout(), std::io::stderr());
    loop {
        match stream::read_frame(&mut reader)? {
            Some((FrameKind::Stdout, d)) => {
                out.write_all(&d)?;
                out.flush()?;
            }
            Some((FrameKind::Stderr, d)) => {
                err.write_all(&d)?;
                err.flush()?;
            }
            Some((FrameKind::Exit, d)) if d.len() == 4 => return Ok(i32::from_be_bytes([d[0], d[1], d[2], d[3]])),
            Some((FrameKind::Error, d)) => bail!("{}", String::from_utf8_lossy(&d)),
            Some(_) => {}
            None => bail!("connection to the daemon closed before the command's exit status arrived"),
        }
    }
}

/// Puts the local terminal in raw mode and restores it on drop.
struct RawTerminal(Option<nix::sys::termios::Termios>);

impl RawTerminal {
    fn enable() -> RawTerminal {
        use nix::sys::termios::{cfmakeraw, tcgetattr, tcsetattr, SetArg};
        let stdin = std::io::stdin();
        let Ok(orig) = tcgetattr(stdin.as_fd()) else { return RawTerminal(None) };
        let mut raw = orig.clone();
        cfmakeraw(&mut raw);
        let _ = tcsetattr(stdin.as_fd(), SetArg::TCSANOW, &raw);
        RawTerminal(Some(orig))
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        if let Some(orig) = &self.0 {
            let _ = nix::sys::termios::tcsetattr(std::io::stdin().as_fd(), nix::sys::termios::SetArg::TCSANOW, orig);
        }
    }
}

fn window_size() -> (u16, u16) {
    strata_shim::sys::window_size(std::io::stdout().as_fd()).unwrap_or((24, 80))
}

/// `strata port`: copy both ways between a port stream and stdin/stdout,
/// or, with `listen`, between each accepted connection and a stream of its own.
pub(super) fn run_port(cli: &Cli, id: &str, port: u16, listen: Option<std::net::SocketAddr>) -> Result<i32> {
    fn join(
        mut early: std::io::Cursor<Vec<u8>>,
        stream: std::os::unix::net::UnixStream,
        mut input: impl std::io::Read + Send + 'static,
        mut output: impl std::io::Write,
    ) -> std::io::Result<()> {
        let mut up = stream.try_clone()?;
        let sender = std::thread::spawn(move || {
            let _ = std::io::copy(&mut input, &mut up);
            let _ = up.shutdown(std::net::Shutdown::Write);
        });
        std::io::copy(&mut early, &mut output)?;
        std::io::copy(&mut &stream, &mut output)?;
        output.flush()?;
        drop(sender);
        Ok(())
    }
    let Some(addr) = listen else {
        let (early, stream) = client(cli)?.port(id, port)?;
        join(early, stream, std::io::stdin(), std::io::stdout().lock())?;
        return Ok(0);
    };
    let listener = std::net::TcpListener::bind(addr).with_context(|| format!("listen on {addr}"))?;
    eprintln!("forwarding {} to port {port} of sandbox {id}", listener.local_addr()?);
    for conn in listener.incoming() {
        let conn = conn?;
        let (early, stream) = client(cli)?.port(id, port)?;
        let out = conn.try_clone()?;
        std::thread::spawn(move || {
            let _ = join(early, stream, conn, out);
        });
    }
    Ok(0)
}
