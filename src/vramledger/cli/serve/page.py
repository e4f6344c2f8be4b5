"""The page ``vramledger serve`` serves: one HTML document with its CSS and script inline (no
network: nothing is fetched but the server's own answers), the form drawn from the TrainingSpec
fields as the CLI's options are (form.py), and the answers filled in from the HTML fragments the
worker renders with ``render/html.py`` (the report's own charts)."""

from __future__ import annotations

from collections.abc import Iterable
from html import escape
from typing import Any

from vramledger.cli.serve.form import FormField, form_fields
from vramledger.cli.serve.question import OPTIONS
from vramledger.inputs.spec_fields import SECTIONS
from vramledger.render.html import CSS

PAGE_CSS = """
[hidden]{display:none!important}
body{max-width:1200px}
form{display:grid;grid-template-columns:repeat(4,minmax(0,1fr));gap:.5rem 1rem;align-items:end;
background:#f7f7f7;padding:1rem;border-radius:6px}
label{display:flex;flex-direction:column;font-size:.85rem;color:#444;gap:.15rem}
label.check{flex-direction:row;align-items:center;gap:.4rem}
.wide{grid-column:span 4}.half{grid-column:span 2}
fieldset{grid-column:span 4;display:grid;grid-template-columns:repeat(4,minmax(0,1fr));
gap:.5rem 1rem;align-items:end;border:1px solid #ddd;border-radius:4px;margin:0}
legend{font-size:.85rem;font-weight:600;color:#333}
textarea{font-family:ui-monospace,monospace;font-size:.8rem;height:7rem}
input,select,textarea,button{font:inherit;font-size:.9rem}
.buttons{display:flex;gap:.6rem;align-items:center;flex-wrap:wrap}
button{padding:.35rem .9rem;border:1px solid #888;border-radius:4px;background:#fff;cursor:pointer}
button.primary{background:#4e79a7;color:#fff;border-color:#4e79a7}
#status{min-height:1.4rem;margin:.6rem 0;color:#555}
#error{white-space:pre-wrap;font-family:ui-monospace,monospace;font-size:.85rem}
#error:empty{display:none}
#error{background:#fdecec;border:1px solid #e9a6a6;padding:.5rem;border-radius:4px}
section{margin-top:1rem}.stale{opacity:.45}
.stale::before{content:'the inputs changed since this answer';display:block;color:#b00;
font-size:.8rem}
"""

SCRIPT = r"""
const $ = (id) => document.getElementById(id);
let current = null;   // the job this page waits for; an older one's answer is ignored
let debounce = null;
const KINDS = {estimate: 'estimating', fit: 'fitting', plan: 'planning', advise: 'advising'};
const SECTIONS = {estimate: ['summary', 'bar', 'ledger'], fit: ['fit'], plan: ['plan'],
                  advise: ['advice']};

function source() { return document.querySelector('input[name=source]:checked').value; }
function model() {
  const s = source();
  return s === 'config' ? $('config').value : s === 'paste' ? $('paste').value : $('code').value;
}
function form() {
  const out = {};
  for (const el of document.querySelectorAll('[data-field]')) {
    out[el.dataset.field] = el.type === 'checkbox' ? el.checked : el.value;
  }
  return out;
}
function showSource() {
  for (const s of ['config', 'paste', 'code']) {
    const box = $('source-' + s);
    if (box) box.hidden = source() !== s;
  }
}
function setError(text) { $('error').textContent = text || ''; }
function setStatus(text) { $('status').textContent = text; }

async function ask(kind) {
  clearTimeout(debounce);
  if (!model().trim()) { setStatus('pick a config first'); return; }
  setError('');
  const body = {kind: kind, source: source(), model: model(), form: form()};
  let response, data;
  try {
    response = await fetch('api/ask', {method: 'POST',
      headers: {'Content-Type': 'application/json'}, body: JSON.stringify(body)});
    data = await response.json();
  } catch (e) {
    setStatus(''); setError('vramledger: error: the server did not answer (' + e + ')'); return;
  }
  if (!response.ok) { current = null; setStatus(''); setError(data.error); return; }
  current = data.job;
  show(data);
}

async function poll(id) {
  if (id !== current) return;
  let data;
  try {
    const response = await fetch('api/jobs/' + id);
    data = await response.json();
    if (!response.ok) { setError(data.error); return; }
  } catch (e) {
    setError('vramledger: error: the server did not answer (' + e + ')'); return;
  }
  if (id === current) show(data);
}

function show(data) {
  const doing = KINDS[data.kind];
  if (data.state === 'waiting' || data.state === 'running') {
    const steps = data.progress.map(([name, done, total]) => `${name} ${done}/${total}`);
    setStatus(`${doing}… ${data.seconds.toFixed(1)} s` +
              (data.state === 'waiting' ? ' (a worker is starting)' : '') +
              (steps.length ? ' · ' + steps.join(' · ') : ''));
    setTimeout(() => poll(data.job), 250);
    return;
  }
  if (data.state === 'done') {
    for (const [part, html] of Object.entries(data.answer)) {
      const el = $(part);
      el.innerHTML = html;
      el.classList.remove('stale');
    }
    const names = SECTIONS[data.kind].map((s) => $(s).closest('section'));
    for (const s of names) s.hidden = false;
    setStatus(`${data.kind}: answered in ${data.seconds.toFixed(1)} s` +
              (data.cached ? ' (from the cache)' : ''));
    document.body.dataset.answered = String(data.job);
  } else {
    setStatus(`${data.kind}: ${data.state}`);
    setError(data.error);
    document.body.dataset.answered = String(data.job);
  }
}

function changed() {
  for (const id of ['summary', 'bar', 'ledger', 'fit', 'plan', 'advice']) {
    if ($(id).innerHTML) $(id).classList.add('stale');
  }
  clearTimeout(debounce);
  if (model().trim()) debounce = setTimeout(() => ask('estimate'), 300);
}

document.addEventListener('DOMContentLoaded', () => {
  for (const el of document.querySelectorAll('input[name=source]')) {
    el.addEventListener('change', () => { showSource(); changed(); });
  }
  for (const el of document.querySelectorAll('[data-field], #config, #code, #paste')) {
    el.addEventListener('change', changed);
  }
  for (const el of document.querySelectorAll('button[data-kind]')) {
    el.addEventListener('click', (e) => { e.preventDefault(); ask(el.dataset.kind); });
  }
  $('form').addEventListener('submit', (e) => { e.preventDefault(); ask('estimate'); });
  showSource();
});
"""


def _options(values: Iterable[str], selected: str | None = None, blank: str | None = None) -> str:
    out = [f"<option value=''>{escape(blank)}</option>"] if blank is not None else []
    for value in values:
        mark = " selected" if value == selected else ""
        out.append(f"<option value='{escape(value)}'{mark}>{escape(value)}</option>")
    return "".join(out)


def _input(field: str, label: str, value: Any = "", kind: str = "text", extra: str = "") -> str:
    return (
        f"<label>{escape(label)}<input id='f-{field}' data-field='{field}' type='{kind}' "
        f"value='{escape(str(value))}' {extra}></label>"
    )


def _select(field: str, label: str, options: str, extra: str = "") -> str:
    return (
        f"<label {extra}>{escape(label)}<select id='f-{field}' data-field='{field}'>{options}"
        "</select></label>"
    )


def _field(f: FormField) -> str:
    """One spec option's input, labelled with the option's name and titled with its help."""
    label = f.name.replace("_", "-")
    title = f"title='{escape(f.help)}'"
    if f.kind == "switch":
        return (
            f"<label class='check' {title}><input id='f-{f.name}' data-field='{f.name}' "
            f"type='checkbox'>{escape(label)}</label>"
        )
    if f.kind == "choice":
        blank = None if f.value else "— default —"
        return _select(f.name, label, _options(f.choices, f.value, blank), title)
    kind = "number" if f.kind == "number" else "text"
    extra = f"{title} placeholder='{escape(f.placeholder)}'"  # the spec says what is too small
    if not f.offered:
        return _input(f.name, label, f.value, kind, extra)
    listed = "".join(f"<option value='{escape(o)}'>" for o in f.offered)
    return _input(
        f.name, label, f.value, kind, f"{extra} list='list-{f.name}' autocomplete='off'"
    ) + (f"<datalist id='list-{f.name}'>{listed}</datalist>")


def _spec_fields() -> list[str]:
    """The form's fields of the spec, a fieldset per section of the spec (as ``--help`` groups
    them), drawn from the fields (form.py), but the code options; then the questions' own
    (fit's ``maximize``, plan's ``max_gpus``)."""
    fields = [f for f in form_fields().values() if not f.code]
    out = []
    for section, title in SECTIONS.items():
        inputs = [_field(f) for f in fields if f.section == section]
        if inputs:
            out.append(f"<fieldset><legend>{escape(title)}</legend>{''.join(inputs)}</fieldset>")
    out.append(
        "<fieldset><legend>fit and plan</legend>"
        + _select("maximize", "fit: maximise", _options(OPTIONS["fit"]["maximize"]))
        + _input("max_gpus", "plan: at most GPUs", 1024, "number", "min='1'")
        + "</fieldset>"
    )
    return out


def page(choices: dict[str, Any]) -> str:
    """The page: its model sources from ``choices`` (the listed configs and the folders the
    server reads), its spec options drawn from the spec's fields as the CLI's are (form.py)."""
    configs = choices["configs"]
    folder = choices["config_dir"]
    code = choices["code_dir"]
    sources = [("config", "a config under the folder"), ("paste", "a pasted config.json")]
    if code:
        sources.append(("code", "FILE.py:FUNCTION"))
    first = "config" if folder else "paste"
    radios = "".join(
        f"<label class='check'><input type='radio' name='source' value='{v}'"
        f"{' checked' if v == first else ''}{'' if folder or v != 'config' else ' disabled'}>"
        f"{escape(text)}</label>"
        for v, text in sources
    )
    where = (
        f"configs under <code>{escape(folder)}</code>"
        if folder
        else "no folder given (start it as <code>vramledger serve DIR</code> to pick configs)"
    )
    if code:
        where += f"; models from Python files under <code>{escape(code)}</code>"
    listed = "".join(f"<option value='{escape(c)}'>" for c in configs)
    boxes = (
        "<div id='source-config' class='wide'><label>config (a .json file or a folder with "
        f"config.json)<input id='config' list='configs' placeholder='pick or type a path "
        f"under the folder' autocomplete='off'></label><datalist id='configs'>{listed}"
        "</datalist></div>"
        "<div id='source-paste' class='wide'><label>config.json<textarea id='paste' "
        "spellcheck='false' placeholder='{\"model_type\": \"llama\", ...}'></textarea></label>"
        "</div>"
    )
    if code:
        boxes += (
            "<div id='source-code' class='wide buttons'><label>model function<input id='code' "
            "placeholder='models.py:build_model'></label>"
            + "".join(_field(f) for f in form_fields().values() if f.code)
            + "</div>"
        )
    fields = _spec_fields()
    buttons = (
        "<div class='buttons wide'>"
        "<button class='primary' data-kind='estimate' id='ask-estimate'>Estimate</button>"
        "<button data-kind='fit' id='ask-fit'>Fit</button>"
        "<button data-kind='plan' id='ask-plan'>Plan</button>"
        "<button data-kind='advise' id='ask-advise'>Advise</button>"
        "<span>a new question cancels the one running</span></div>"
    )
    sections = (
        "<section><p id='summary'></p><div id='bar'></div></section>"
        "<section hidden><h2>Fit</h2><div id='fit'></div></section>"
        "<section hidden><h2>Plan</h2><div id='plan'></div></section>"
        "<section hidden><h2>Advice</h2><div id='advice'></div></section>"
        "<section><div id='ledger'></div></section>"
    )
    return (
        "<!DOCTYPE html>\n<html lang='en'><head><meta charset='utf-8'>"
        "<title>vramledger</title><link rel='icon' href='data:,'>"
        f"<style>{CSS}{PAGE_CSS}</style><script>{SCRIPT}</script></head><body>"
        "<h1>vramledger: will this training step fit?</h1>"
        f"<p>{where}. Answers are predicted on fake tensors; nothing is downloaded.</p>"
        f"<form id='form' autocomplete='off'><div class='wide buttons'>{radios}</div>{boxes}"
        + "".join(fields)
        + buttons
        + "</form><div id='status'></div><div id='error'></div>"
        + sections
        + "</body></html>\n"
    )
