"""Wrapping a description the way shop exports do: plain text, or HTML with CSS and JavaScript.

Styles, and how often each is drawn (`MARKUP_WEIGHTS`):

- `plain`: paragraphs, a "Features:" list, a "Brand:" line;
- `html_basic`: `<p>`, `<ul>`, `<strong>`, `<br>`, entities, editor attributes;
- `html_nested`: nested `<div>`/`<span>` with inline `style` attributes and `&nbsp;`;
- `html_style`: an inline `<style>` sheet before the markup;
- `json_ld`: a `<script type="application/ld+json">` Product block (brand, name, offer);
- `tracking`: a `<script>` with a `dataLayer` push (brand, name) or an analytics loader;
- `microdata`: schema.org microdata with `<meta itemprop="brand" content="...">`.

The useful sentences always survive inside the markup. `BRAND_CARRIERS` names,
per style, the structural element that can carry the brand on its own.
"""

from __future__ import annotations

import html
import json
import random
from typing import TYPE_CHECKING

from schemas import Condition

if TYPE_CHECKING:  # imported for annotations only; plan.py imports this module
    from vlm_catalog.data.synthetic.descriptions import DescriptionContent
    from vlm_catalog.data.synthetic.plan import ProductPlan

MARKUP_STYLES = (
    "plain",
    "html_basic",
    "html_nested",
    "html_style",
    "json_ld",
    "tracking",
    "microdata",
)
MARKUP_WEIGHTS = (48, 15, 10, 8, 8, 7, 4)
BRAND_CARRIERS = {"json_ld": "json_ld", "tracking": "tracking", "microdata": "meta"}

_SCHEMA_CONDITION = {
    Condition.new: "https://schema.org/NewCondition",
    Condition.like_new: "https://schema.org/UsedCondition",
    Condition.used: "https://schema.org/UsedCondition",
    Condition.refurbished: "https://schema.org/RefurbishedCondition",
}
_CSS_RULES = (
    '.product-description{{font-family:"Helvetica Neue",Arial,sans-serif;color:#{grey};'
    "line-height:1.6}}",
    ".product-description p{{margin:0 0 {gap}px}}",
    ".product-description ul{{padding-left:1.2em;list-style:disc}}",
    ".product-description strong{{font-weight:600}}",
    "@media (max-width:{width}px){{.product-description{{font-size:14px}}}}",
    ".pd-badge{{display:inline-block;background:#f4f4f4;border-radius:3px;padding:2px 6px}}",
)
_FONT_STYLES = (
    "font-size: 14px;",
    "font-family: arial, helvetica, sans-serif;",
    "color: #333333;",
    "line-height: 1.5;",
    "font-weight: 400;",
)


def _escape(text: str, rng: random.Random) -> str:
    """HTML-escape `text` and, sometimes, use the entities shop editors produce."""
    escaped = html.escape(text, quote=False)
    if rng.random() < 0.4:
        escaped = escaped.replace("'", rng.choice(("&#39;", "&rsquo;", "&#8217;")))
    if rng.random() < 0.3:
        escaped = escaped.replace(" - ", " &ndash; ").replace(". ", ".&nbsp; ", 1)
    return escaped


def _plain(content: DescriptionContent, rng: random.Random) -> str:
    separator = "\n\n" if rng.random() < 0.7 else " "
    parts = [" ".join(paragraph) for paragraph in content.paragraphs if paragraph]
    text = separator.join(parts)
    if content.features:
        bullet = rng.choice(("- ", "* ", "\u2022 "))
        heading = rng.choice(("Features:", "Key features:", "Details:"))
        text += f"\n\n{heading}\n" + "\n".join(bullet + item for item in content.features)
    if content.brand_line:
        text += "\n" + content.brand_line
    return text


def _html_body(content: DescriptionContent, rng: random.Random) -> str:
    editor = ' data-mce-fragment="1"' if rng.random() < 0.3 else ""
    joiner = "<br>" if rng.random() < 0.25 else " "
    blocks = [
        f"<p{editor}>{joiner.join(_escape(s, rng) for s in paragraph)}</p>"
        for paragraph in content.paragraphs
        if paragraph
    ]
    if content.features:
        items = "".join(f"<li>{_escape(item, rng)}</li>" for item in content.features)
        blocks.append(
            f"<p><strong>{rng.choice(('Features', 'Details'))}</strong></p><ul>{items}</ul>"
        )
    if content.brand_line:
        label, _, brand = content.brand_line.partition(": ")
        blocks.append(f"<p><strong>{label}:</strong> {_escape(brand, rng)}</p>")
    if rng.random() < 0.3:
        blocks.insert(0, "<!-- description start -->")
    return "\n".join(blocks) if rng.random() < 0.5 else "".join(blocks)


def _nested(content: DescriptionContent, rng: random.Random) -> str:
    inner = []
    for paragraph in content.paragraphs:
        for sentence in paragraph:
            style = " ".join(rng.sample(_FONT_STYLES, k=2))
            inner.append(f'<div><span style="{style}">{_escape(sentence, rng)}</span>&nbsp;</div>')
    for item in content.features:
        inner.append(f'<div class="spec-row"><span>{_escape(item, rng)}</span></div>')
    if content.brand_line:
        inner.append(f'<div class="brand"><span>{_escape(content.brand_line, rng)}</span></div>')
    return (
        '<div class="product-single__description rte">'
        f'<div class="pd-section" style="text-align: left;">{"".join(inner)}</div></div>'
    )


def _stylesheet(rng: random.Random) -> str:
    rules = rng.sample(_CSS_RULES, k=rng.randint(3, len(_CSS_RULES)))
    sheet = "\n".join(
        rule.format(
            grey=rng.choice(("333", "444", "222")),
            gap=rng.choice((8, 10, 12)),
            width=rng.choice((600, 749, 768)),
        )
        for rule in rules
    )
    return f"<style>\n{sheet}\n</style>"


def _json_ld(plan: ProductPlan, title: str, rng: random.Random) -> str:
    product: dict[str, object] = {
        "@context": "https://schema.org",
        "@type": "Product",
        "name": title,
        "brand": {"@type": "Brand", "name": plan.brand},
        "sku": f"{plan.brand[:3].upper()}-{rng.randint(10000, 99999)}",
        "material": plan.attributes.material.value,
    }
    if plan.colour_in_description:
        product["color"] = plan.colour_word
    offer: dict[str, object] = {
        "@type": "Offer",
        "priceCurrency": rng.choice(("USD", "EUR", "GBP", "CAD")),
        "price": f"{rng.randint(5, 300)}.{rng.choice(('00', '95', '99'))}",
        "availability": "https://schema.org/InStock",
    }
    # The condition is stated only where the plan allows a cue (never for image-only cues),
    # and only half the time, so its absence says nothing.
    condition = plan.attributes.condition
    if (condition is Condition.new or plan.condition_cue_in_description) and rng.random() < 0.5:
        offer["itemCondition"] = _SCHEMA_CONDITION[condition]
    product["offers"] = offer
    indent = 2 if rng.random() < 0.5 else None
    body = json.dumps(product, ensure_ascii=False, indent=indent).replace("</", "<\\/")
    return f'<script type="application/ld+json">\n{body}\n</script>'


def _tracking(plan: ProductPlan, title: str, rng: random.Random, with_brand: bool) -> str:
    if with_brand:
        item = {
            "item_id": str(rng.randint(10**9, 10**10 - 1)),
            "item_name": title,
            "item_brand": plan.brand,
            "item_category": plan.top_level,
            "price": round(rng.uniform(5, 300), 2),
        }
        push = json.dumps(
            {"event": "view_item", "ecommerce": {"items": [item]}}, ensure_ascii=False
        )
        code = f"window.dataLayer = window.dataLayer || [];\ndataLayer.push({push});"
    else:
        pixel_id = rng.randint(100000, 999999)
        code = (
            "!function(w,d,s){var t=d.createElement(s);t.async=!0;"
            f"t.src='https://cdn.shop-metrics.example/px.js?id=SM-{pixel_id}';"
            "var f=d.getElementsByTagName(s)[0];f.parentNode.insertBefore(t,f)}"
            "(window,document,'script');"
        )
    code = code.replace("</", "<\\/")
    return f"<script>\n{code}\n</script>"


def render_description(
    content: DescriptionContent, plan: ProductPlan, title: str, rng: random.Random
) -> str:
    """The description text of `plan.markup` style around `content`."""
    style = plan.markup
    if style == "plain":
        return _plain(content, rng)
    if style == "html_basic":
        return _html_body(content, rng)
    if style == "html_nested":
        return _nested(content, rng)
    if style == "html_style":
        return (
            f'{_stylesheet(rng)}\n<div class="product-description">{_html_body(content, rng)}</div>'
        )
    if style == "json_ld":
        body = _html_body(content, rng) if rng.random() < 0.7 else _plain(content, rng)
        return f"{_json_ld(plan, title, rng)}\n{body}"
    if style == "tracking":
        with_brand = plan.brand_in_description == "tracking" or rng.random() < 0.5
        script = _tracking(plan, title, rng, with_brand)
        body = _html_body(content, rng) if rng.random() < 0.6 else _plain(content, rng)
        return f"{script}\n{body}" if rng.random() < 0.5 else f"{body}\n{script}"
    if style == "microdata":
        sku = rng.randint(10000, 99999)
        return (
            '<div itemscope itemtype="https://schema.org/Product">'
            f'<meta itemprop="brand" content="{html.escape(plan.brand)}">'
            f'<meta itemprop="sku" content="{sku}">'
            f'<div itemprop="description">{_html_body(content, rng)}</div></div>'
        )
    raise ValueError(f"unknown markup style {style!r}; choose one of: {', '.join(MARKUP_STYLES)}")
