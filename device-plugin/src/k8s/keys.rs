//! [`AssignmentKeys`]: the public keys this plugin verifies assignments with.
//!
//! The extender signs every `gpuplace.io/assignment` with an Ed25519 key only its replicas hold, and
//! its leader publishes the public halves in a ConfigMap (`gpuplace-system/gpuplace-assignment-public-keys`
//! by default; `gpuplace_core::signing`). A plugin that reads them can verify an assignment and
//! cannot forge one, so neither a tenant who edits its own pod's annotation nor another node's
//! plugin can hand a container GPUs the extender did not give it.
//!
//! - The ConfigMap is watched by name (`metadata.name` field selector, which RBAC's
//!   `resourceNames` can authorize), so a rotation applies without a restart.
//! - A signature naming a key not loaded yet (a rotation whose ConfigMap change is on its way) makes
//!   the caller [`reload`](AssignmentKeys::reload) once, with a GET, before refusing.
//! - A malformed ConfigMap keeps the last good keys and is logged; absent keys verify nothing, so
//!   every assignment is refused (never trusted) until the extender has published.

use std::sync::{Arc, RwLock};
use std::time::Duration;

use futures::StreamExt;
use gpuplace_core::signing::PublicKeys;
use k8s_openapi::api::core::v1::ConfigMap;
use kube::runtime::watcher::{self, Event};
use kube::runtime::WatchStreamExt;
use kube::{Api, Client};
use tokio::task::JoinHandle;

use super::call;
use crate::sampler::Telemetry;

/// Default namespace and name of the public-key ConfigMap (the extender's defaults).
pub const DEFAULT_PUBLIC_KEYS: (&str, &str) = ("gpuplace-system", "gpuplace-assignment-public-keys");

/// See the module docs.
pub struct AssignmentKeys {
    current: RwLock<PublicKeys>,
    source: Option<(Api<ConfigMap>, String)>,
    telemetry: Option<Arc<Telemetry>>,
    timeout: Duration,
    watch: Option<JoinHandle<()>>,
}

impl Drop for AssignmentKeys {
    fn drop(&mut self) {
        if let Some(w) = &self.watch {
            w.abort();
        }
    }
}

impl AssignmentKeys {
    /// Keys that never change (tests, and a plugin told its keys by file).
    pub fn fixed(keys: PublicKeys) -> Arc<Self> {
        Arc::new(Self {
            current: RwLock::new(keys),
            source: None,
            telemetry: None,
            timeout: Duration::ZERO,
            watch: None,
        })
    }

    /// Watches ConfigMap `namespace/name`; `timeout` limits each [`reload`](Self::reload). Needs a
    /// tokio runtime.
    pub fn watch(
        client: Client,
        namespace: &str,
        name: &str,
        telemetry: Arc<Telemetry>,
        timeout: Duration,
    ) -> Arc<Self> {
        let api: Api<ConfigMap> = Api::namespaced(client, namespace);
        Arc::new_cyclic(|weak: &std::sync::Weak<Self>| {
            let weak = weak.clone();
            let (api2, name2) = (api.clone(), name.to_string());
            let watch = tokio::spawn(async move {
                let config = watcher::Config::default().fields(&format!("metadata.name={name2}"));
                let mut stream = watcher::watcher(api2, config).default_backoff().boxed();
                let mut failing = false;
                while let Some(ev) = stream.next().await {
                    let Some(me) = weak.upgrade() else { return };
                    match ev {
                        Ok(Event::Apply(cm) | Event::InitApply(cm)) => {
                            failing = false;
                            me.install(&cm);
                        }
                        Ok(Event::Delete(_)) => {
                            tracing::warn!(configmap = %name2, "the assignment public-key ConfigMap was deleted; keeping the keys loaded until the extender publishes again");
                        }
                        Ok(_) => failing = false,
                        Err(e) => {
                            if !failing {
                                tracing::warn!(configmap = %name2, error = %e, "watching the assignment public keys failed; retrying");
                            }
                            failing = true;
                        }
                    }
                }
            });
            Self {
                current: RwLock::new(PublicKeys::default()),
                source: Some((api, name.to_string())),
                telemetry: Some(telemetry),
                timeout,
                watch: Some(watch),
            }
        })
    }

    /// The keys loaded now (a few dozen bytes each: cloned, not locked across an await).
    pub fn current(&self) -> PublicKeys {
        self.current.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn install(&self, cm: &ConfigMap) {
        let data = cm.data.clone().unwrap_or_default();
        match PublicKeys::from_configmap_data(&data) {
            Ok(keys) => {
                let mut current = self.current.write().unwrap_or_else(|e| e.into_inner());
                if *current != keys {
                    tracing::info!(keys = ?keys.ids(), "assignment public keys loaded");
                    *current = keys;
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "the assignment public-key ConfigMap is malformed; keeping the keys loaded before")
            }
        }
    }

    /// Reads the ConfigMap afresh (a signature named a key not loaded). Whether the keys changed.
    pub async fn reload(&self) -> bool {
        let Some((api, name)) = &self.source else { return false };
        let before = self.current();
        match call("configmap_get", self.timeout, api.get_opt(name)).await {
            Ok(Some(cm)) => self.install(&cm),
            Ok(None) => {
                tracing::warn!(configmap = %name, "no assignment public-key ConfigMap; every assignment is refused until the extender publishes it")
            }
            Err(e) => {
                if let Some(t) = &self.telemetry {
                    t.api_error("configmap_get");
                }
                tracing::warn!(configmap = %name, error = %e, "reading the assignment public keys failed");
            }
        }
        self.current() != before
    }
}
