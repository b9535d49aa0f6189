//! Lets kubelet's Go gRPC clients that dial a bare socket path talk to our tonic servers.
//!
//! kubelet's plugin watcher (plugin registration, `GetInfo`) dials the socket by its path without
//! naming an authority, so grpc-go sends the path, percent-encoded, as HTTP/2's `:authority`
//! (`%2Fvar%2Flib%2Fkubelet%2F...`). That is not a valid authority, and h2 (under tonic) resets the
//! stream with `PROTOCOL_ERROR`: kubelet logs `RegisterPlugin error -- failed to get plugin info
//! ... PROTOCOL_ERROR` and never registers the driver (seen with the v1.36 kubelet on the real node
//! of tests/e2e/real_node/dra.rs; Kubernetes fixed the device plugin and CSI clients the same way in
//! PR 112597, not this one). Go servers do not check the authority.
//!
//! So each accepted connection goes through [`incoming`]: the bytes from kubelet are read as HTTP/2
//! frames and in every header block a literal `:authority` (HPACK static name index 1) gets the
//! value `localhost`, what grpc-go sends for `unix:` targets; everything else, and the whole other
//! direction, passes unchanged. Header blocks are walked, never decoded: names are matched by index
//! and string literals (Huffman or not) skipped by their length. The rewritten value is stored by
//! the server's HPACK decoder where the client stored the path, so later requests that refer to it
//! by index read `localhost` too; the server's dynamic table then holds a smaller entry than the
//! client's, and keeps at least every entry the client still refers to (indices count from the
//! newest entry). A header block that does not parse is passed on as it came (the server then
//! refuses it as before).

use std::io;

use tokio::io::{AsyncReadExt, AsyncWriteExt, DuplexStream};
use tokio::net::UnixListener;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const FRAME_HEADER: usize = 9;
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// SETTINGS_MAX_FRAME_SIZE's initial value: rewritten blocks are sent in frames of at most this.
const MAX_FRAME: usize = 16_384;
/// A frame longer than this is not HTTP/2 from kubelet: the connection is passed through as is.
const MAX_ACCEPTED_FRAME: usize = 1 << 24;
const AUTHORITY: &[u8] = b"localhost";

/// An HPACK integer with an `n`-bit prefix at the start of `b`: (value, bytes used).
fn integer(b: &[u8], n: u32) -> Option<(usize, usize)> {
    let mask = (1usize << n) - 1;
    let mut v = usize::from(*b.first()?) & mask;
    if v < mask {
        return Some((v, 1));
    }
    let mut shift = 0u32;
    for (i, &byte) in b.iter().enumerate().skip(1) {
        v = v.checked_add(usize::from(byte & 0x7f).checked_shl(shift)?)?;
        if byte & 0x80 == 0 {
            return Some((v, i + 1));
        }
        shift += 7;
        if shift > 28 {
            return None;
        }
    }
    None
}

/// The length of the string literal at the start of `b`.
fn string_len(b: &[u8]) -> Option<usize> {
    let (len, used) = integer(b, 7)?;
    let end = used.checked_add(len)?;
    (end <= b.len()).then_some(end)
}

/// A header block with every literal `:authority` (static name index 1) valued `localhost`;
/// `None` when the block does not parse.
pub fn rewrite_block(block: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(block.len());
    let mut i = 0;
    while i < block.len() {
        let b = block[i];
        let rest = &block[i..];
        if b & 0x80 != 0 {
            // indexed field
            let (_, used) = integer(rest, 7)?;
            out.extend_from_slice(&rest[..used]);
            i += used;
            continue;
        }
        if b & 0xe0 == 0x20 {
            // dynamic table size update
            let (_, used) = integer(rest, 5)?;
            out.extend_from_slice(&rest[..used]);
            i += used;
            continue;
        }
        // a literal: with incremental indexing (01), without indexing (0000) or never indexed (0001)
        let prefix = if b & 0xc0 == 0x40 { 6 } else { 4 };
        let (name, mut at) = integer(rest, prefix)?;
        if name == 0 {
            at += string_len(rest.get(at..)?)?;
        }
        let value_len = string_len(rest.get(at..)?)?;
        if name == 1 {
            out.extend_from_slice(&rest[..at]);
            out.push(AUTHORITY.len() as u8);
            out.extend_from_slice(AUTHORITY);
        } else {
            out.extend_from_slice(&rest[..at + value_len]);
        }
        i += at + value_len;
    }
    Some(out)
}

fn frame_header(len: usize, kind: u8, flags: u8, stream: &[u8]) -> [u8; FRAME_HEADER] {
    let l = (len as u32).to_be_bytes();
    [l[1], l[2], l[3], kind, flags, stream[0], stream[1], stream[2], stream[3]]
}

/// The client's side of one connection, frame by frame.
#[derive(Default)]
pub struct Rewriter {
    buf: Vec<u8>,
    preface_done: bool,
    /// Nothing more to rewrite: bytes pass as they come (not HTTP/2, or a frame too large).
    passthrough: bool,
    /// A header block waiting for its CONTINUATION frames.
    pending: Option<Pending>,
}

/// HEADERS flags (without PADDED), its priority fields, the stream, the block so far.
type Pending = (u8, Vec<u8>, [u8; 4], Vec<u8>);

impl Rewriter {
    /// Takes bytes from the client and appends what goes to the server to `out`.
    pub fn feed(&mut self, input: &[u8], out: &mut Vec<u8>) {
        if self.passthrough {
            out.extend_from_slice(input);
            return;
        }
        self.buf.extend_from_slice(input);
        if !self.preface_done {
            let n = self.buf.len().min(PREFACE.len());
            if self.buf[..n] != PREFACE[..n] {
                self.give_up(out);
                return;
            }
            if self.buf.len() < PREFACE.len() {
                return;
            }
            out.extend_from_slice(PREFACE);
            self.buf.drain(..PREFACE.len());
            self.preface_done = true;
        }
        while self.buf.len() >= FRAME_HEADER {
            let len = (usize::from(self.buf[0]) << 16) | (usize::from(self.buf[1]) << 8) | usize::from(self.buf[2]);
            if len > MAX_ACCEPTED_FRAME {
                self.give_up(out);
                return;
            }
            if self.buf.len() < FRAME_HEADER + len {
                return;
            }
            let frame: Vec<u8> = self.buf.drain(..FRAME_HEADER + len).collect();
            self.frame(&frame, out);
        }
    }

    /// Passes everything from here on unchanged.
    fn give_up(&mut self, out: &mut Vec<u8>) {
        if let Some((flags, prio, stream, block)) = self.pending.take() {
            self.emit(flags & !END_HEADERS, &prio, &stream, &block, out);
        }
        out.append(&mut self.buf);
        self.passthrough = true;
    }

    fn frame(&mut self, frame: &[u8], out: &mut Vec<u8>) {
        let (kind, flags) = (frame[3], frame[4]);
        let mut stream = [0u8; 4];
        stream.copy_from_slice(&frame[5..9]);
        let payload = &frame[FRAME_HEADER..];
        match kind {
            HEADERS => {
                let mut body = payload;
                if flags & PADDED != 0 {
                    let Some((&pad, rest)) = body.split_first() else { return out.extend_from_slice(frame) };
                    let Some(end) = rest.len().checked_sub(usize::from(pad)) else {
                        return out.extend_from_slice(frame);
                    };
                    body = &rest[..end];
                }
                let prio_len = if flags & PRIORITY != 0 { 5 } else { 0 };
                if body.len() < prio_len {
                    return out.extend_from_slice(frame);
                }
                let (prio, block) = body.split_at(prio_len);
                self.pending = Some((flags & !PADDED, prio.to_vec(), stream, block.to_vec()));
            }
            CONTINUATION if self.pending.as_ref().is_some_and(|p| p.2 == stream) => {
                if let Some(p) = self.pending.as_mut() {
                    p.3.extend_from_slice(payload);
                    p.0 |= flags & END_HEADERS;
                }
            }
            _ => return out.extend_from_slice(frame),
        }
        if self.pending.as_ref().is_some_and(|p| p.0 & END_HEADERS != 0) {
            if let Some((flags, prio, stream, block)) = self.pending.take() {
                let block = rewrite_block(&block).unwrap_or(block);
                self.emit(flags, &prio, &stream, &block, out);
            }
        }
    }

    /// A header block as HEADERS and CONTINUATION frames of at most [`MAX_FRAME`].
    fn emit(&self, flags: u8, prio: &[u8], stream: &[u8; 4], block: &[u8], out: &mut Vec<u8>) {
        let end = flags & END_HEADERS;
        let first = block.len().min(MAX_FRAME - prio.len());
        let (head, mut rest) = block.split_at(first);
        let f = if rest.is_empty() { flags } else { flags & !END_HEADERS };
        out.extend_from_slice(&frame_header(prio.len() + head.len(), HEADERS, f, stream));
        out.extend_from_slice(prio);
        out.extend_from_slice(head);
        while !rest.is_empty() {
            let (chunk, r) = rest.split_at(rest.len().min(MAX_FRAME));
            rest = r;
            let f = if rest.is_empty() { end } else { 0 };
            out.extend_from_slice(&frame_header(chunk.len(), CONTINUATION, f, stream));
            out.extend_from_slice(chunk);
        }
    }
}

/// The connections of `listener`, each through a [`Rewriter`], as streams a tonic server takes.
pub fn incoming(listener: UnixListener) -> ReceiverStream<io::Result<DuplexStream>> {
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(async move {
        loop {
            let conn = match listener.accept().await {
                Ok((conn, _)) => conn,
                Err(e) => {
                    if tx.send(Err(e)).await.is_err() {
                        return;
                    }
                    continue;
                }
            };
            let (ours, theirs) = tokio::io::duplex(1 << 16);
            if tx.send(Ok(theirs)).await.is_err() {
                return;
            }
            tokio::spawn(pump(conn, ours));
        }
    });
    ReceiverStream::new(rx)
}

/// Client bytes through the rewriter to the server, server bytes straight back, until either side
/// closes.
async fn pump(conn: tokio::net::UnixStream, server: DuplexStream) {
    let (mut client_r, mut client_w) = conn.into_split();
    let (mut server_r, mut server_w) = tokio::io::split(server);
    let up = async {
        let mut rw = Rewriter::default();
        let mut buf = vec![0u8; 1 << 14];
        let mut out = Vec::new();
        loop {
            let n = client_r.read(&mut buf).await?;
            if n == 0 {
                return server_w.shutdown().await;
            }
            out.clear();
            rw.feed(&buf[..n], &mut out);
            server_w.write_all(&out).await?;
        }
    };
    let down = async {
        tokio::io::copy(&mut server_r, &mut client_w).await?;
        client_w.shutdown().await
    };
    let _: (io::Result<()>, io::Result<()>) = tokio::join!(up, down);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A literal with incremental indexing of static name 1 (:authority), raw value.
    fn authority_literal(value: &[u8]) -> Vec<u8> {
        let mut v = vec![0x41, value.len() as u8];
        v.extend_from_slice(value);
        v
    }

    #[test]
    fn integers_follow_rfc_7541() {
        assert_eq!(integer(&[0x0a], 5), Some((10, 1)));
        // 1337 with a 5-bit prefix: 31, 154, 10
        assert_eq!(integer(&[0x1f, 0x9a, 0x0a], 5), Some((1337, 3)));
        assert_eq!(integer(&[0x1f, 0x9a], 5), None);
        assert_eq!(integer(&[], 5), None);
    }

    #[test]
    fn only_the_authority_changes_in_a_block() {
        // :method POST (indexed 3), :scheme http (6), :path literal without indexing of name 4,
        // :authority as grpc-go sends a socket path, a literal name, and a Huffman-flagged value
        let mut block = vec![0x83, 0x86];
        block.extend_from_slice(&[0x04, 5]);
        block.extend_from_slice(b"/x/Go");
        block.extend(authority_literal(b"%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fx.sock"));
        block.extend_from_slice(&[0x40, 2, b't', b'e', 0x82, 0xff, 0xff]);
        block.extend_from_slice(&[0x3f, 0xe1, 0x1f]); // size update 4096
        let out = rewrite_block(&block).unwrap();
        let mut want = vec![0x83, 0x86, 0x04, 5];
        want.extend_from_slice(b"/x/Go");
        want.extend(authority_literal(b"localhost"));
        want.extend_from_slice(&[0x40, 2, b't', b'e', 0x82, 0xff, 0xff, 0x3f, 0xe1, 0x1f]);
        assert_eq!(out, want);
        // a valid block without an authority is unchanged; truncated ones do not parse
        assert_eq!(rewrite_block(&[0x83, 0x86]).unwrap(), [0x83, 0x86]);
        assert_eq!(rewrite_block(&[0x41, 9, b'a']), None);
        assert_eq!(rewrite_block(&[0x40, 2, b't']), None);
    }

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let mut f = frame_header(payload.len(), kind, flags, &stream.to_be_bytes()).to_vec();
        f.extend_from_slice(payload);
        f
    }

    #[test]
    fn frames_are_rewritten_across_continuations_padding_and_split_reads() {
        let block = [vec![0x83], authority_literal(b"%2Fsock")].concat();
        let rewritten = [vec![0x83], authority_literal(b"localhost")].concat();
        let settings = frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100]);
        // padded HEADERS with priority, then a CONTINUATION with the rest of the block
        let mut padded = vec![2u8];
        padded.extend_from_slice(&[0, 0, 0, 0, 16]);
        padded.extend_from_slice(&block[..2]);
        padded.extend_from_slice(&[0, 0]);
        let input = [
            PREFACE.to_vec(),
            settings.clone(),
            frame(HEADERS, PADDED | PRIORITY, 1, &padded),
            frame(CONTINUATION, END_HEADERS, 1, &block[2..]),
            frame(0x0, 0x1, 1, b"data"),
        ]
        .concat();
        let want = [
            PREFACE.to_vec(),
            settings,
            frame(HEADERS, PRIORITY | END_HEADERS, 1, &[&[0, 0, 0, 0, 16][..], &rewritten].concat()),
            frame(0x0, 0x1, 1, b"data"),
        ]
        .concat();
        // whole, and one byte at a time
        for step in [input.len(), 1, 7] {
            let mut rw = Rewriter::default();
            let mut out = Vec::new();
            for chunk in input.chunks(step) {
                rw.feed(chunk, &mut out);
            }
            assert_eq!(out, want, "reads of {step} bytes");
        }
        // not HTTP/2: passed on untouched
        let mut rw = Rewriter::default();
        let mut out = Vec::new();
        rw.feed(b"GET / HTTP/1.1\r\n\r\n", &mut out);
        assert_eq!(out, b"GET / HTTP/1.1\r\n\r\n");
    }

    #[test]
    fn a_large_block_goes_out_in_frames_the_server_accepts() {
        // a literal name "n" and a 255-byte value (its length: 127 + 128 in two more bytes)
        let mut block = vec![0x40, 0x01, b'n', 0x7f, 0x80, 0x01];
        block.extend(std::iter::repeat_n(b'a', 255));
        let big: Vec<u8> = (0..100).flat_map(|_| block.clone()).collect();
        let mut out = Vec::new();
        let mut rw = Rewriter::default();
        rw.feed(&[PREFACE.to_vec(), frame(HEADERS, END_HEADERS, 3, &big)].concat(), &mut out);
        let mut at = PREFACE.len();
        let mut got = Vec::new();
        let mut kinds = Vec::new();
        while at < out.len() {
            let len = (usize::from(out[at]) << 16) | (usize::from(out[at + 1]) << 8) | usize::from(out[at + 2]);
            assert!(len <= MAX_FRAME);
            kinds.push((out[at + 3], out[at + 4] & END_HEADERS));
            got.extend_from_slice(&out[at + 9..at + 9 + len]);
            at += 9 + len;
        }
        assert_eq!(got, big);
        assert_eq!(kinds.first(), Some(&(HEADERS, 0)));
        assert_eq!(kinds.last(), Some(&(CONTINUATION, END_HEADERS)));
    }
}
