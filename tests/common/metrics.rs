//! Scraping `/metrics`: one series of a node's or a gateway's, and a sum of series.

use super::Gateway;
use std::collections::HashMap;

/// One series of a node's `/metrics` (`name{labels}`), 0 when it is not exported.
pub async fn metric(url: &str, series: &str) -> f64 {
    let text = reqwest::get(url).await.unwrap().text().await.unwrap();
    let m: HashMap<&str, f64> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k, v.parse().ok()?))
        })
        .collect();
    m.get(series).copied().unwrap_or(0.0)
}

/// The sum of every series of a `/metrics` whose `name{labels` starts with `prefix`.
pub async fn metric_sum(url: &str, prefix: &str) -> f64 {
    let text = reqwest::get(url).await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// The gateway's `/metrics` text, read with `token`.
async fn gateway_metrics(gw: &Gateway, token: &str) -> String {
    reqwest::Client::new()
        .get(format!("{}/metrics", gw.base))
        .bearer_auth(token)
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// The sum of every series of the gateway's `/metrics` (read with `token`) whose
/// `name{labels` starts with `prefix`.
pub async fn gateway_metric_sum(gw: &Gateway, token: &str, prefix: &str) -> f64 {
    gateway_metrics(gw, token)
        .await
        .lines()
        .filter(|l| l.starts_with(prefix))
        .filter_map(|l| l.rsplit_once(' ')?.1.parse::<f64>().ok())
        .sum()
}

/// One series of the gateway's `/metrics` (read with `token`), 0 when absent; and
/// whether it is exported at all.
pub async fn gateway_metric(gw: &Gateway, token: &str, series: &str) -> (f64, bool) {
    let text = gateway_metrics(gw, token).await;
    let v = text
        .lines()
        .filter_map(|l| l.rsplit_once(' '))
        .find(|(k, _)| *k == series)
        .and_then(|(_, v)| v.parse().ok());
    (v.unwrap_or(0.0), v.is_some())
}
