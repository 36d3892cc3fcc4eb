//! What every chart shares: the embedded font, the colour palette, tick labels, legends.

use crate::{Canvas, ChartError};
use plotters::prelude::*;
// The trait behind .filled() / .stroke_width(); our own `Color` struct keeps the name.
use plotters::style::text_anchor::{HPos, Pos, VPos};
use plotters::style::Color as _;
use plotters::style::FontStyle;
use std::sync::OnceLock;

/// DejaVu Sans (Bitstream Vera licence, see fonts/LICENSE_DEJAVU), from matplotlib's wheel.
static DEJAVU_SANS: &[u8] = include_bytes!("../fonts/DejaVuSans.ttf");

/// The family name plotters asks for when no font is given (axis labels, legends).
pub(crate) const FAMILY: &str = "sans-serif";
pub(crate) const TITLE_PX: f64 = 22.0;
pub(crate) const CAPTION_PX: f64 = 18.0;
pub(crate) const LABEL_PX: f64 = 15.0;
pub(crate) const TICK_PX: f64 = 13.0;

/// Make the embedded font the one plotters uses for every family and style.
///
/// plotters' `ab_glyph` backend looks fonts up in a process-wide table that can only be filled
/// through `register_font`; we fill it once with the same immutable bytes (bold and italic fall
/// back to the regular face), so the table never changes after the first chart.
pub(crate) fn register_embedded_font() -> Result<(), ChartError> {
    static REGISTERED: OnceLock<bool> = OnceLock::new();
    let ok = *REGISTERED.get_or_init(|| {
        ["sans-serif", "serif", "monospace"].iter().all(|family| {
            plotters::style::register_font(family, FontStyle::Normal, DEJAVU_SANS).is_ok()
        })
    });
    if ok {
        Ok(())
    } else {
        Err(ChartError::Render(
            "the embedded DejaVu Sans font could not be parsed".into(),
        ))
    }
}

pub(crate) fn font(px: f64) -> TextStyle<'static> {
    TextStyle::from((FAMILY, px).into_font())
}

/// An sRGB colour, for callers that want to pin a category's colour (e.g. idle time in grey).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Color(pub u8, pub u8, pub u8);

impl Color {
    pub const IDLE_GREY: Color = Color(200, 200, 200);

    pub(crate) fn rgb(self) -> RGBColor {
        RGBColor(self.0, self.1, self.2)
    }

    /// Black on light fills, white on dark ones (relative luminance, ITU-R BT.709 weights).
    pub(crate) fn text_on(self) -> RGBColor {
        let luminance = 0.2126 * self.0 as f64 + 0.7152 * self.1 as f64 + 0.0722 * self.2 as f64;
        if luminance > 140.0 {
            BLACK
        } else {
            WHITE
        }
    }
}

/// Tableau 10: distinct hues that stay distinguishable for the common colour-vision deficiencies.
/// Series and categories without a pinned colour take these in order of first appearance.
pub const PALETTE: [Color; 10] = [
    Color(31, 119, 180),
    Color(255, 127, 14),
    Color(44, 160, 44),
    Color(214, 39, 40),
    Color(148, 103, 189),
    Color(140, 86, 75),
    Color(227, 119, 194),
    Color(127, 127, 127),
    Color(188, 189, 34),
    Color(23, 190, 207),
];

/// Gives each name (series, category) one colour for the whole figure, in order of first
/// appearance, so "eval loss" is the same colour in every panel; pinned names keep theirs.
pub(crate) struct ColorMap {
    assigned: Vec<(String, Color)>,
    next: usize,
}

impl ColorMap {
    pub(crate) fn new(pinned: &[(String, Color)]) -> Self {
        ColorMap {
            assigned: pinned.to_vec(),
            next: 0,
        }
    }

    pub(crate) fn color(&mut self, name: &str) -> Color {
        if let Some((_, c)) = self.assigned.iter().find(|(n, _)| n == name) {
            return *c;
        }
        let c = PALETTE[self.next % PALETTE.len()];
        self.next += 1;
        self.assigned.push((name.to_owned(), c));
        c
    }
}

/// Short tick labels: "0.25", "1200", "3e-4", "1.5e6" rather than "0.25000000000000006".
pub(crate) fn format_tick(v: f64) -> String {
    if v == 0.0 {
        return "0".into();
    }
    let magnitude = v.abs();
    if !(1e-3..1e5).contains(&magnitude) {
        let s = format!("{v:.1e}");
        return s.replace(".0e", "e");
    }
    let s = format!("{v:.4}");
    let s = s.trim_end_matches('0').trim_end_matches('.');
    s.to_owned()
}

/// Width in pixels of a legend with these entries, for reserving room beside a chart.
pub(crate) fn legend_width(canvas: &Canvas, names: &[&str]) -> Result<u32, ChartError> {
    let mut widest = 0;
    for name in names {
        widest = widest.max(canvas.estimate_text_size(name, &font(LABEL_PX))?.0);
    }
    Ok(widest + 48)
}

/// Draw a boxed legend of colour blocks whose top-left corner is at `(x, y)` pixels.
pub(crate) fn draw_legend(
    canvas: &Canvas,
    entries: &[(String, Color)],
    (x, y): (i32, i32),
) -> Result<(), ChartError> {
    let names: Vec<&str> = entries.iter().map(|(n, _)| n.as_str()).collect();
    let width = legend_width(canvas, &names)? as i32 - 8;
    let row = (LABEL_PX * 1.6) as i32;
    let height = row * entries.len() as i32 + 8;
    canvas.draw(&Rectangle::new(
        [(x, y), (x + width, y + height)],
        WHITE.filled(),
    ))?;
    canvas.draw(&Rectangle::new(
        [(x, y), (x + width, y + height)],
        BLACK.stroke_width(1),
    ))?;
    for (i, (name, color)) in entries.iter().enumerate() {
        let cy = y + 4 + row * i as i32 + row / 2;
        canvas.draw(&Rectangle::new(
            [(x + 8, cy - 6), (x + 24, cy + 6)],
            color.rgb().filled(),
        ))?;
        canvas.draw_text(
            name,
            &font(LABEL_PX).pos(Pos::new(HPos::Left, VPos::Center)),
            (x + 32, cy),
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tick_labels_are_short() {
        let cases = [
            (0.0, "0"),
            (0.25, "0.25"),
            (0.1 + 0.2, "0.3"),
            (1200.0, "1200"),
            (-2.5, "-2.5"),
            (3e-4, "3e-4"),
            (1.5e6, "1.5e6"),
            (0.001, "0.001"),
        ];
        for (v, want) in cases {
            assert_eq!(format_tick(v), want, "{v}");
        }
    }

    #[test]
    fn colours_follow_first_appearance_and_respect_pins() {
        let mut map = ColorMap::new(&[("idle".to_owned(), Color::IDLE_GREY)]);
        let a = map.color("train loss");
        let b = map.color("eval loss");
        assert_ne!(a, b);
        assert_eq!(map.color("train loss"), a);
        assert_eq!(map.color("idle"), Color::IDLE_GREY);
        assert_eq!(a, PALETTE[0]);
        assert_eq!(b, PALETTE[1]);
    }

    #[test]
    fn label_colour_contrasts_with_fill() {
        assert_eq!(Color(255, 255, 255).text_on(), BLACK);
        assert_eq!(Color(31, 119, 180).text_on(), WHITE);
        assert_eq!(Color::IDLE_GREY.text_on(), BLACK);
    }
}
