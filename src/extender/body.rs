//! Reading a verb's request body under the server's limits: a size cap, a pace, and one large body
//! at a time.
//!
//! - **Size**: over `max_bytes` (declared in `Content-Length`, or counted while a chunked body
//!   streams) is refused at once with 413; nothing past the cap is buffered.
//! - **Pace**: the body must keep arriving at `min_bytes_per_sec` on average after a `grace`: after
//!   `n` bytes the reader waits until `grace + n / min_bytes_per_sec` from the first read, then
//!   gives up with 408. A client that declares 2 MB and sends nothing, or trickles a byte a second,
//!   is cut after the grace instead of holding a worker's connection and memory.
//! - **Large bodies**: the gate for bodies over `large_bytes` (decided off the HTTP workers, one at a
//!   time) is taken when the bytes read cross that size, not from what a header declares: a
//!   connection that only declares a large body holds nothing, and chunked bodies pass the same gate.
//!   Each waiting reader holds at most `large_bytes` plus one chunk, and stops reading while it waits
//!   (TCP pushes back on its client), so concurrent large uploads cost one large body and a little
//!   more per connection. The wait is not counted against the pace; longer than `large_wait` is 503.

use std::sync::Arc;
use std::time::Duration;

use actix_web::web::{Bytes, BytesMut};
use futures::StreamExt;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

/// Limits on reading one request body.
#[derive(Debug, Clone)]
pub struct BodyLimits {
    pub max_bytes: usize,
    /// Bodies over this are decided one at a time (the gate).
    pub large_bytes: usize,
    /// Time before the pace applies (connection set-up, the client's own encoding).
    pub grace: Duration,
    /// The slowest average rate accepted after the grace.
    pub min_bytes_per_sec: u64,
    /// The longest wait for the large-body gate.
    pub large_wait: Duration,
}

/// 2 s before the pace applies.
pub const DEFAULT_GRACE: Duration = Duration::from_secs(2);
/// 1 MiB/s: kube-scheduler sends from inside the cluster, thousands of times faster; a 4 MiB body
/// may take 6 s in all.
pub const DEFAULT_MIN_BYTES_PER_SEC: u64 = 1 << 20;
/// 30 s for the large-body gate: kube-scheduler's default extender `httpTimeout` is 30 s.
pub const DEFAULT_LARGE_WAIT: Duration = Duration::from_secs(30);

/// Why a body was not read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("request body is larger than the extender accepts (--max-body-bytes {max})")]
    TooLarge { max: usize },
    #[error(
        "request body arrived too slowly: {received} bytes in {secs:.1} s, below {rate} bytes/s after a {grace:.0} s grace; \
         the extender stopped reading"
    )]
    TooSlow { received: usize, secs: f64, rate: u64, grace: f64 },
    #[error("another large request is being decided; retry")]
    Busy,
    #[error("reading the request body: {0}")]
    Read(String),
}

impl BodyError {
    pub fn http_status(&self) -> u16 {
        match self {
            BodyError::TooLarge { .. } => 413,
            BodyError::TooSlow { .. } => 408,
            BodyError::Busy => 503,
            BodyError::Read(_) => 400,
        }
    }
}

/// A body read whole, with the large-body gate's permit when it crossed `large_bytes` (held until
/// the request is decided).
#[derive(Debug)]
pub struct Body {
    pub bytes: Bytes,
    pub permit: Option<OwnedSemaphorePermit>,
}

/// Reads `payload` to its end under `limits`; `declared` is the `Content-Length`, if any.
pub async fn read_body<S, E>(
    mut payload: S,
    declared: Option<usize>,
    limits: &BodyLimits,
    large: &Arc<Semaphore>,
) -> Result<Body, BodyError>
where
    S: futures::Stream<Item = Result<Bytes, E>> + Unpin,
    E: std::fmt::Display,
{
    if declared.is_some_and(|n| n > limits.max_bytes) {
        return Err(BodyError::TooLarge { max: limits.max_bytes });
    }
    // reserve what was declared up to the large size; past it only once the gate is held
    let mut buf = BytesMut::with_capacity(declared.unwrap_or(0).min(limits.large_bytes));
    let mut permit = None;
    let started = Instant::now();
    let mut waited = Duration::ZERO;
    let rate = limits.min_bytes_per_sec.max(1);
    loop {
        let allowed = limits.grace + Duration::from_secs_f64(buf.len() as f64 / rate as f64) + waited;
        let chunk = match tokio::time::timeout_at(started + allowed, payload.next()).await {
            Err(_) => {
                return Err(BodyError::TooSlow {
                    received: buf.len(),
                    secs: (started.elapsed() - waited).as_secs_f64(),
                    rate,
                    grace: limits.grace.as_secs_f64(),
                })
            }
            Ok(None) => break,
            Ok(Some(Err(e))) => return Err(BodyError::Read(e.to_string())),
            Ok(Some(Ok(chunk))) => chunk,
        };
        let total = buf.len() + chunk.len();
        if total > limits.max_bytes {
            return Err(BodyError::TooLarge { max: limits.max_bytes });
        }
        if permit.is_none() && total > limits.large_bytes {
            let t = Instant::now();
            let got = tokio::time::timeout(limits.large_wait, large.clone().acquire_owned()).await;
            permit = Some(got.map_err(|_| BodyError::Busy)?.map_err(|_| BodyError::Busy)?);
            waited += t.elapsed();
            if let Some(n) = declared {
                buf.reserve(n.saturating_sub(buf.len()));
            }
        }
        buf.extend_from_slice(&chunk);
    }
    Ok(Body { bytes: buf.freeze(), permit })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits() -> BodyLimits {
        BodyLimits {
            max_bytes: 100,
            large_bytes: 10,
            grace: Duration::from_millis(200),
            min_bytes_per_sec: 100,
            large_wait: Duration::from_millis(300),
        }
    }

    fn chunks(parts: &[&'static [u8]]) -> impl futures::Stream<Item = Result<Bytes, String>> + Unpin {
        futures::stream::iter(parts.iter().map(|p| Ok(Bytes::from_static(p))).collect::<Vec<_>>())
    }

    #[tokio::test]
    async fn a_body_is_read_whole_and_the_gate_taken_only_past_the_large_size() {
        let gate = Arc::new(Semaphore::new(1));
        let b = read_body(chunks(&[b"abc", b"def"]), Some(6), &limits(), &gate).await.unwrap();
        assert_eq!((&b.bytes[..], b.permit.is_some()), (&b"abcdef"[..], false));
        let b = read_body(chunks(&[b"0123456789", b"x"]), None, &limits(), &gate).await.unwrap();
        assert_eq!((b.bytes.len(), b.permit.is_some()), (11, true));
        // held: the next large body waits, then gives up with Busy
        let e = read_body(chunks(&[b"0123456789ab"]), None, &limits(), &gate).await.unwrap_err();
        assert!(matches!(e, BodyError::Busy), "{e}");
        drop(b);
        assert!(read_body(chunks(&[b"0123456789ab"]), None, &limits(), &gate).await.unwrap().permit.is_some());
    }

    #[tokio::test]
    async fn over_the_cap_is_refused_declared_or_counted() {
        let gate = Arc::new(Semaphore::new(1));
        let e = read_body(chunks(&[b"a"]), Some(101), &limits(), &gate).await.unwrap_err();
        assert_eq!(e.http_status(), 413);
        let big: &'static [u8] = &[b'x'; 60];
        let e = read_body(chunks(&[big, big]), None, &limits(), &gate).await.unwrap_err();
        assert_eq!(e.http_status(), 413, "{e}");
    }

    #[tokio::test]
    async fn a_body_that_stalls_or_trickles_is_cut_after_the_grace() {
        let gate = Arc::new(Semaphore::new(1));
        // declares a body, sends nothing
        let e = read_body(futures::stream::pending::<Result<Bytes, String>>(), Some(50), &limits(), &gate)
            .await
            .unwrap_err();
        assert_eq!(e.http_status(), 408, "{e}");
        // a byte every 100 ms is 10 bytes/s, below 100: cut once the grace and its credit run out
        let trickle = futures::stream::unfold(0u8, |i| async move {
            tokio::time::sleep(Duration::from_millis(100)).await;
            Some((Ok::<Bytes, String>(Bytes::from(vec![i])), i.wrapping_add(1)))
        });
        let t = Instant::now();
        let e = read_body(Box::pin(trickle), None, &limits(), &gate).await.unwrap_err();
        assert_eq!(e.http_status(), 408, "{e}");
        assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
    }
}
