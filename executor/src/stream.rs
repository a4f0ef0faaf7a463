//! The framed byte stream of an attached exec, after the HTTP connection is
//! upgraded (`Upgrade: strata-exec`), like Docker's attach multiplexing.
//!
//! Every frame is `kind: u8, len: u32 big-endian, payload`. Server → client:
//! stdout, stderr, exit (payload: i32 BE shell exit code), error (payload:
//! UTF-8 message; the command's fate is unknown, e.g. its shim died or the
//! sandbox was removed, and the stream ends). Client → server: stdin (an
//! empty payload closes stdin), resize (rows u16 BE, cols u16 BE).

use std::io::{self, Read, Write};

/// Largest payload accepted in one frame.
pub const MAX_FRAME: usize = 1 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum FrameKind {
    Stdin = 0,
    Stdout = 1,
    Stderr = 2,
    Resize = 3,
    Exit = 4,
    Error = 5,
}

impl FrameKind {
    fn from_u8(b: u8) -> Option<FrameKind> {
        Some(match b {
            0 => FrameKind::Stdin,
            1 => FrameKind::Stdout,
            2 => FrameKind::Stderr,
            3 => FrameKind::Resize,
            4 => FrameKind::Exit,
            5 => FrameKind::Error,
            _ => return None,
        })
    }
}

pub fn write_frame(w: &mut impl Write, kind: FrameKind, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len()).map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too big"))?;
    let mut head = [0u8; 5];
    head[0] = kind as u8;
    head[1..].copy_from_slice(&len.to_be_bytes());
    w.write_all(&head)?;
    w.write_all(payload)?;
    w.flush()
}

/// Read one frame; `Ok(None)` on a clean end of stream.
pub fn read_frame(r: &mut impl Read) -> io::Result<Option<(FrameKind, Vec<u8>)>> {
    let mut head = [0u8; 5];
    match r.read_exact(&mut head) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(e),
    }
    let kind = FrameKind::from_u8(head[0])
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, format!("unknown frame kind {}", head[0])))?;
    let len = u32::from_be_bytes([head[1], head[2], head[3], head[4]]) as usize;
    if len > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidData, format!("frame of {len} bytes exceeds {MAX_FRAME}")));
    }
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    Ok(Some((kind, payload)))
}

pub fn resize_payload(rows: u16, cols: u16) -> [u8; 4] {
    let mut p = [0u8; 4];
    p[..2].copy_from_slice(&rows.to_be_bytes());
    p[2..].copy_from_slice(&cols.to_be_bytes());
    p
}

pub fn parse_resize(p: &[u8]) -> Option<(u16, u16)> {
    (p.len() == 4).then(|| (u16::from_be_bytes([p[0], p[1]]), u16::from_be_bytes([p[2], p[3]])))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_round_trip() {
        let mut buf = Vec::new();
        write_frame(&mut buf, FrameKind::Stdout, b"hello").unwrap();
        write_frame(&mut buf, FrameKind::Resize, &resize_payload(24, 80)).unwrap();
        write_frame(&mut buf, FrameKind::Stdin, b"").unwrap();
        let mut r = &buf[..];
        assert_eq!(read_frame(&mut r).unwrap(), Some((FrameKind::Stdout, b"hello".to_vec())));
        let (k, p) = read_frame(&mut r).unwrap().unwrap();
        assert_eq!((k, parse_resize(&p)), (FrameKind::Resize, Some((24, 80))));
        assert_eq!(read_frame(&mut r).unwrap(), Some((FrameKind::Stdin, vec![])));
        assert_eq!(read_frame(&mut r).unwrap(), None);
    }

    #[test]
    fn bad_frames_are_errors() {
        assert!(read_frame(&mut &[9u8, 0, 0, 0, 0][..]).is_err());
        assert!(read_frame(&mut &[1u8, 0xff, 0xff, 0xff, 0xff][..]).is_err());
        assert!(read_frame(&mut &[1u8, 0, 0, 0, 5, b'a'][..]).is_err(), "truncated payload");
    }
}
