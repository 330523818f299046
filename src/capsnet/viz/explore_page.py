"""The layout of the `capsnet explore` page: Gradio components wired to `capsnet.viz.explore.Explorer`'s
callbacks. Only the panels that apply to the model are built; the page lists the others and why."""

from __future__ import annotations

from typing import Any

from . import explore_model as em

INTRO = """### {title}: inside the capsules
Upload an image, draw one or pick one of the test images; it is converted as `capsnet predict` converts it.
The bars are the class capsules' lengths |v_j| (the probability that class j is present)."""


def build_page(ex, gr):
    """The gr.Blocks of explorer `ex`."""
    f = ex.features
    ui: dict[str, Any] = {}
    with gr.Blocks(title=f"capsnet explore: {ex.title}", analytics_enabled=False) as page:
        state = gr.State(None)
        ui["state"] = state
        gr.Markdown(INTRO.format(title=ex.title))
        if ex.note:
            gr.Markdown(f"**Note:** {ex.note}", elem_id="note")
        if f.hidden:
            gr.Markdown(
                "**Not shown for this model:**\n" + "\n".join(f"- {h}" for h in f.hidden), elem_id="hidden-panels"
            )
        with gr.Row():
            with gr.Column(scale=1):
                with gr.Tab("Upload"):
                    upload = gr.Image(
                        type="filepath", sources=["upload"], label="image (PNG, JPEG)", elem_id="upload", height=240
                    )
                with gr.Tab("Draw"):
                    sketch = gr.Sketchpad(label="draw a digit", elem_id="sketchpad", canvas_size=(280, 280), height=300)
                    sketch_go = gr.Button("Classify the drawing", elem_id="classify-drawing")
                with gr.Tab("Test images", elem_id="gallery-tab"):
                    gallery = gr.Gallery(
                        value=[str(p) for p in ex.gallery_paths],
                        label="the run's test images",
                        columns=6,
                        height=240,
                        allow_preview=False,
                        elem_id="gallery",
                        interactive=False,
                    )
                    if not ex.gallery_paths:
                        gr.Markdown("No test images: the model records no data set it was trained on.")
                ui["message"] = gr.Markdown("", elem_id="message")
            with gr.Column(scale=1):
                ui["prediction"] = gr.Markdown("Prediction: (no image yet)", elem_id="prediction")
                ui["lengths"] = gr.BarPlot(
                    x="class",
                    y="length",
                    title="class capsule lengths",
                    y_lim=[0, 1],
                    sort=None,
                    elem_id="lengths",
                    height=260,
                )
                choice = gr.Dropdown(
                    ["predicted", *ex.names], value="predicted", label="class capsule", elem_id="capsule-choice"
                )
        sliders: list[Any] = []
        with gr.Row():
            if f.decoder:
                with gr.Column(scale=1):
                    ui["reconstruction"] = gr.Image(
                        label="reconstruction from the class capsule (Fig. 4)",
                        type="numpy",
                        elem_id="reconstruction",
                        height=200,
                        interactive=False,
                    )
                    reset = gr.Button("Reset the poses", elem_id="reset")
                with gr.Column(scale=2):
                    gr.Markdown(
                        f"**Pose:** one slider per dimension of the chosen capsule (offset in "
                        f"[−{em.POSE_RANGE}, {em.POSE_RANGE}], as the paper's Fig. 4)"
                    )
                    with gr.Row():
                        for d in range(f.pose_dim):
                            sliders.append(
                                gr.Slider(
                                    -em.POSE_RANGE,
                                    em.POSE_RANGE,
                                    value=0.0,
                                    step=0.01,
                                    label=f"dimension {d}",
                                    elem_id=f"pose-{d}",
                                    min_width=140,
                                )
                            )
            elif f.pose_dim:
                label = "pose matrix M_j and activation (EM)" if f.matrix_pose else "class capsule pose v_j"
                ui["poses"] = gr.Dataframe(label=label, elem_id="poses", interactive=False)
            if f.branches:
                headers = ["class", *(f"branch {b + 1}" for b in range(f.branches))]
                ui["branches"] = gr.Dataframe(
                    headers=headers, label="capsule lengths of each branch (HVC)", elem_id="branches", interactive=False
                )
            if f.routing:
                with gr.Column(scale=1):
                    where = "the input capsule grid" if f.routing == "grid" else "the input capsules"
                    ui["routing"] = gr.Image(
                        label=f"coupling c_ij to the chosen class over {where} (Fig. 2 / capsnet visualize routing)",
                        type="numpy",
                        elem_id="routing",
                        height=200,
                        interactive=False,
                    )
                    iteration = gr.Slider(
                        1,
                        max(2, f.iterations),
                        value=f.iterations,
                        step=1,
                        label="routing iteration",
                        elem_id="iteration",
                        visible=f.iterations > 1,
                    )
        _wire(ex, gr, ui, sliders, locals())
    return page


def _wire(ex, gr, ui: dict[str, Any], sliders: list[Any], c: dict[str, Any]) -> None:
    """Connect the events: a new image redraws everything (poses at rest), a slider the reconstruction only."""
    f = ex.features
    shown = list(ui.values())
    iteration = c.get("iteration")

    def to_page(result: dict[str, Any], *, rest: bool) -> dict:
        out = {ui[k]: v for k, v in result.items() if k in ui}
        if rest and "state" in result:
            out.update({s: 0.0 for s in sliders})
            if iteration is not None:
                out[iteration] = f.iterations
        if "lengths" in result:
            import pandas as pd

            out[ui["lengths"]] = pd.DataFrame(result["lengths"])
        return out

    outputs = shown + sliders + ([iteration] if iteration is not None else [])
    c["upload"].upload(lambda p: to_page(ex.classify(p), rest=True), c["upload"], outputs)
    c["sketch_go"].click(lambda v: to_page(ex.drawing(v), rest=True), c["sketch"], outputs)

    def picked(evt):
        return to_page(ex.gallery_pick(int(evt.index)), rest=True)

    picked.__annotations__ = {"evt": gr.SelectData}  # how Gradio knows to pass the event

    c["gallery"].select(picked, None, outputs)

    def redraw(a, choice, it, *offsets):
        if a is None:
            return {}
        j = ex.chosen(a, choice)
        return to_page(
            ex.capsule_panels(a, j, list(offsets) or [0.0] * f.pose_dim, int(it or f.iterations)), rest=False
        )

    it_input = [iteration] if iteration is not None else [gr.State(f.iterations)]
    c["choice"].change(redraw, [ui["state"], c["choice"], *it_input, *sliders], outputs)
    if iteration is not None:
        iteration.change(redraw, [ui["state"], c["choice"], iteration, *sliders], outputs)
    if f.decoder:

        def moved(a, choice, *offsets):
            if a is None:
                return None
            return ex.reconstruction(a, ex.chosen(a, choice), list(offsets))

        for s in sliders:
            s.input(moved, [ui["state"], c["choice"], *sliders], ui["reconstruction"], show_progress="hidden")
        c["reset"].click(
            lambda a, choice: [0.0] * len(sliders) + [moved(a, choice, *([0.0] * len(sliders)))],
            [ui["state"], c["choice"]],
            [*sliders, ui["reconstruction"]],
        )
