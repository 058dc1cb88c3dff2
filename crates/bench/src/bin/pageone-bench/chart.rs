//! Drawing a [`Figure`] (panels of grouped bars or of lines, side by side) into a PNG file with
//! plotters' bitmap backend. Text is drawn with a TrueType font read at run time (see
//! [`FONT_FILES`]): plotters then links no fontconfig or freetype.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use anyhow::{anyhow, bail, Context, Result};
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::FontStyle;

/// A plot: a title over panels side by side.
#[derive(Debug)]
pub struct Figure {
    pub title: String,
    pub panels: Vec<Panel>,
}

#[derive(Debug)]
pub struct Panel {
    pub title: String,
    pub body: Body,
}

#[derive(Debug)]
pub enum Body {
    /// Bars per group (x) and series (colour); `None`: not measured (drawn as "n/a").
    Bars {
        groups: Vec<String>,
        series: Vec<Series<Option<f64>>>,
    },
    /// Lines of (x, y) points per series, `x` described by `x_desc`.
    Lines {
        x_desc: String,
        series: Vec<Series<(f64, f64)>>,
    },
}

#[derive(Debug)]
pub struct Series<T> {
    pub name: String,
    pub values: Vec<T>,
}

/// Series colours, in order: pageone's blue, the baselines' orange, then grey and green.
const COLOURS: [RGBColor; 4] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(127, 127, 127),
    RGBColor(44, 160, 44),
];

const PANEL_WIDTH: u32 = 520;
/// Room for a long title over a single panel.
const MIN_WIDTH: u32 = 960;
const HEIGHT: u32 = 440;
const FAMILY: &str = "sans-serif";

/// TrueType files tried for text, after `$PAGEONE_BENCH_FONT`: Debian's fonts-dejavu-core (which
/// `scripts/test.sh` installs), then fonts-liberation's and fonts-noto-core's sans.
pub const FONT_FILES: [&str; 3] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/noto/NotoSans-Regular.ttf",
];

/// The first font file that exists: `explicit` if given, else one of [`FONT_FILES`].
pub fn font_file(explicit: Option<PathBuf>) -> Result<PathBuf> {
    if let Some(p) = explicit {
        if !p.is_file() {
            bail!(
                "the font file {} (PAGEONE_BENCH_FONT) does not exist",
                p.display()
            );
        }
        return Ok(p);
    }
    FONT_FILES
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
        .ok_or_else(|| {
            anyhow!(
                "no TrueType font to draw text with: install one (`apt-get install \
                 fonts-dejavu-core`) or point PAGEONE_BENCH_FONT at a .ttf file"
            )
        })
}

/// Registers the font for plotters once per process (its bytes live as long as the process).
fn register_font() -> Result<()> {
    static DONE: OnceLock<std::result::Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let path = font_file(std::env::var_os("PAGEONE_BENCH_FONT").map(Into::into))
            .map_err(|e| e.to_string())?;
        let bytes = std::fs::read(&path)
            .map_err(|e| format!("could not read the font {}: {e}", path.display()))?;
        plotters::style::register_font(FAMILY, FontStyle::Normal, Box::leak(bytes.into()))
            .map_err(|_| format!("{} is not a TrueType font plotters can use", path.display()))
    })
    .clone()
    .map_err(anyhow::Error::msg)
}

/// A value as a bar label: two decimals under 10, else at most one (none if it is whole).
pub fn value_text(v: f64) -> String {
    if v.abs() < 10.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.1}").trim_end_matches(".0").to_string()
    }
}

/// A value as an axis label: no trailing zeros.
fn tick_text(v: f64) -> String {
    let s = format!("{v:.2}");
    s.trim_end_matches('0').trim_end_matches('.').to_string()
}

/// Draws `fig` into a PNG file at `out`.
pub fn draw(fig: &Figure, out: &Path) -> Result<()> {
    register_font()?;
    if fig.panels.is_empty() {
        bail!("nothing to plot");
    }
    let width = (PANEL_WIDTH * fig.panels.len() as u32).max(MIN_WIDTH);
    let root = BitMapBackend::new(out, (width, HEIGHT)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(&fig.title, (FAMILY, 18))?;
    let areas = root.split_evenly((1, fig.panels.len()));
    for (panel, area) in fig.panels.iter().zip(&areas) {
        match &panel.body {
            Body::Bars { groups, series } => bars(area, &panel.title, groups, series)?,
            Body::Lines { x_desc, series } => lines(area, &panel.title, x_desc, series)?,
        }
    }
    root.present()
        .with_context(|| format!("could not write {}", out.display()))?;
    Ok(())
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

fn bars(area: &Area, title: &str, groups: &[String], series: &[Series<Option<f64>>]) -> Result<()> {
    let top = series
        .iter()
        .flat_map(|s| s.values.iter().flatten())
        .fold(0.0f64, |m, &v| m.max(v));
    let top = if top > 0.0 { top * 1.3 } else { 1.0 };
    let n = groups.len() as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(title, (FAMILY, 15))
        .margin(12)
        .x_label_area_size(28)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..n, 0.0..top)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .light_line_style(TRANSPARENT)
        .y_label_formatter(&|y| tick_text(*y))
        .label_style((FAMILY, 13))
        .draw()?;
    // The groups' names under their bars (plotters' category axes cannot hold grouped bars).
    let (bx, by) = area.get_base_pixel();
    let under = TextStyle::from((FAMILY, 13).into_font()).pos(Pos::new(HPos::Center, VPos::Top));
    for (g, name) in groups.iter().enumerate() {
        let (x, y) = chart.backend_coord(&(g as f64 + 0.5, 0.0));
        area.draw(&Text::new(
            name.as_str(),
            (x - bx, y - by + 8),
            under.clone(),
        ))?;
    }
    let width = 0.8 / series.len().max(1) as f64;
    let label = TextStyle::from((FAMILY, 12).into_font()).pos(Pos::new(HPos::Center, VPos::Bottom));
    for (k, s) in series.iter().enumerate() {
        let colour = COLOURS[k % COLOURS.len()];
        let slot = |g: usize| g as f64 + 0.1 + k as f64 * width;
        chart
            .draw_series(s.values.iter().enumerate().filter_map(|(g, v)| {
                v.map(|v| Rectangle::new([(slot(g), 0.0), (slot(g) + width, v)], colour.filled()))
            }))?
            .label(s.name.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 10, y + 5)], colour.filled()));
        chart.draw_series(s.values.iter().enumerate().map(|(g, v)| {
            let text = v.map_or("n/a".to_string(), value_text);
            Text::new(
                text,
                (slot(g) + width / 2.0, v.unwrap_or(0.0)),
                label.clone(),
            )
        }))?;
    }
    if series.len() < 2 {
        return Ok(());
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FAMILY, 13))
        .draw()?;
    Ok(())
}

fn lines(area: &Area, title: &str, x_desc: &str, series: &[Series<(f64, f64)>]) -> Result<()> {
    let points = || series.iter().flat_map(|s| s.values.iter());
    let (x0, x1) = points().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
    if x0 > x1 {
        bail!("a line panel ({title}) has no points");
    }
    let pad = ((x1 - x0) * 0.03).max(0.5);
    let top = points().fold(0.0f64, |m, p| m.max(p.1)) * 1.3;
    let top = if top > 0.0 { top } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(title, (FAMILY, 15))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(56)
        .build_cartesian_2d(x0 - pad..x1 + pad, 0.0..top)?;
    chart
        .configure_mesh()
        .light_line_style(TRANSPARENT)
        .x_desc(x_desc)
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| tick_text(*y))
        .label_style((FAMILY, 13))
        .draw()?;
    for (k, s) in series.iter().enumerate() {
        let colour = COLOURS[k % COLOURS.len()];
        chart
            .draw_series(LineSeries::new(
                s.values.iter().copied(),
                colour.stroke_width(2),
            ))?
            .label(s.name.as_str())
            .legend(move |(x, y)| PathElement::new([(x, y), (x + 14, y)], colour.stroke_width(2)));
        chart.draw_series(s.values.iter().map(|&p| Circle::new(p, 3, colour.filled())))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FAMILY, 13))
        .draw()?;
    Ok(())
}
