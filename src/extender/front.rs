//! The extender as a front end of the online scheduler: each verb's body decoded into the
//! scheduler's input ([`adapt`](crate::extender::adapt)), the scheduler's decision encoded as the
//! answer kube-scheduler reads. `Err` is always a body that cannot be used (the HTTP layer answers
//! 400); every decision, a refusal included, is an answer.

use std::ops::Deref;
use std::sync::Arc;

use crate::extender::answers;
use crate::extender::args_decoder::decode_args;
use crate::extender::wire::{
    decode, ExtenderBindingArgs, ExtenderBindingResult, ExtenderFilterResult, ExtenderPreemptionArgs,
    ExtenderPreemptionResult, HostPriorityList, WireError,
};
use crate::scheduler::verdict_cache::FilterDecision;
use crate::scheduler::Scheduler;

/// The extender: the online scheduler with kube-scheduler's extender protocol in front. It derefs
/// to the [`Scheduler`], whose seams (the watchers', inspect, metrics) are the same for every
/// front end.
#[derive(Debug, Clone)]
pub struct Extender {
    scheduler: Arc<Scheduler>,
}

impl Deref for Extender {
    type Target = Scheduler;

    fn deref(&self) -> &Scheduler {
        &self.scheduler
    }
}

impl From<Scheduler> for Extender {
    fn from(s: Scheduler) -> Self {
        Self::new(Arc::new(s))
    }
}

impl Extender {
    pub fn new(scheduler: Arc<Scheduler>) -> Self {
        Self { scheduler }
    }

    /// The scheduler this front end serves, shared with the others (the API-server watchers).
    pub fn scheduler(&self) -> &Arc<Scheduler> {
        &self.scheduler
    }

    /// The filter verb, answered as the wire type.
    pub fn filter(&self, body: &[u8]) -> Result<ExtenderFilterResult, WireError> {
        let args = decode_args(body)?;
        Ok(match self.scheduler.filter(args.query()?) {
            FilterDecision::Error(e) => ExtenderFilterResult::error(e),
            FilterDecision::Judged(c, verdicts) => answers::filter_result(&args, &c, &verdicts),
        })
    }

    /// [`Self::filter`] as the JSON body kube-scheduler reads, encoded directly (what the HTTP
    /// service sends).
    pub fn filter_json(&self, body: &[u8]) -> Result<Vec<u8>, WireError> {
        let args = decode_args(body)?;
        Ok(match self.scheduler.filter(args.query()?) {
            FilterDecision::Error(e) => serde_json::to_vec(&ExtenderFilterResult::error(e)).unwrap_or_default(),
            FilterDecision::Judged(c, verdicts) => answers::filter_json(&args, &c, &verdicts),
        })
    }

    /// The prioritize verb, answered as the wire type.
    pub fn prioritize(&self, body: &[u8]) -> Result<HostPriorityList, WireError> {
        let args = decode_args(body)?;
        let (names, scores) = self.scheduler.prioritize(args.query()?);
        Ok(answers::priorities(&names, &scores))
    }

    /// [`Self::prioritize`] as the JSON body kube-scheduler reads.
    pub fn prioritize_json(&self, body: &[u8]) -> Result<Vec<u8>, WireError> {
        let args = decode_args(body)?;
        let (names, scores) = self.scheduler.prioritize(args.query()?);
        Ok(answers::priorities_json(&names, args.names_verbatim(), &scores))
    }

    /// The bind verb: a failed bind is an answer with `Error` set.
    pub async fn bind(&self, body: &[u8]) -> Result<ExtenderBindingResult, WireError> {
        let args: ExtenderBindingArgs = decode(body)?;
        Ok(match self.scheduler.bind(&args.order()).await {
            Ok(()) => ExtenderBindingResult::ok(),
            Err(e) => ExtenderBindingResult::error(e),
        })
    }

    /// The preempt verb.
    pub fn preempt(&self, body: &[u8]) -> Result<ExtenderPreemptionResult, WireError> {
        let args: ExtenderPreemptionArgs = decode(body)?;
        Ok(ExtenderPreemptionResult::of(self.scheduler.preempt(args.query())))
    }
}
