//! `gpuplace report`: one self-contained HTML file with SVG charts, and a terminal summary, from
//! placement logs (`serve --placement-log`), `simulate --json` results, or both.
//!
//! Pure: [`input`] parses, [`model`] works out the figures, [`charts`] draws them, [`html`] writes the
//! page; nothing here touches anything but the input files.

pub mod charts;
pub mod html;
pub mod input;
pub mod model;

use std::path::PathBuf;

use crate::placement_log::read::InputError;
use crate::report::charts::ChartError;
use crate::report::model::{LogModel, SimModel};

/// Why a report could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error(transparent)]
    Input(#[from] InputError),
    #[error(transparent)]
    Chart(#[from] ChartError),
    #[error("nothing to report on: give --placement-log FILE, --simulate FILE, or both")]
    NoInput,
}

/// The inputs' figures.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub log: Option<LogModel>,
    pub sim: Option<SimModel>,
}

impl Report {
    /// Reads placement logs (in the order given: a rotated `PATH.1` before `PATH`) and `simulate
    /// --json` files.
    pub fn read(placement_logs: &[PathBuf], simulate: &[PathBuf]) -> Result<Self, ReportError> {
        if placement_logs.is_empty() && simulate.is_empty() {
            return Err(ReportError::NoInput);
        }
        let log = if placement_logs.is_empty() {
            None
        } else {
            let files = placement_logs
                .iter()
                .map(|p| Ok((p.clone(), crate::placement_log::read::read_placement_log(p)?)))
                .collect::<Result<Vec<_>, InputError>>()?;
            Some(LogModel::build(files))
        };
        let sim = if simulate.is_empty() {
            None
        } else {
            let files = simulate
                .iter()
                .map(|p| Ok((p.clone(), input::read_simulate(p)?)))
                .collect::<Result<Vec<_>, InputError>>()?;
            Some(SimModel::build(files))
        };
        Ok(Self { log, sim })
    }

    /// The HTML page, and how many charts it holds.
    pub fn html(&self) -> Result<(String, usize), ReportError> {
        Ok(html::render(self.log.as_ref(), self.sim.as_ref())?)
    }

    /// The terminal summary.
    pub fn summary(&self) -> String {
        html::summary(self.log.as_ref(), self.sim.as_ref())
    }
}
