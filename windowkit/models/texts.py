"""Short English passages (written for windowkit, public domain) for real-weights checks on text models.

``verify --model smollm2`` builds its chunks from these with the model's chat template: the first chunk opens
the user turn, the query closes it and opens the assistant turn.
"""
from __future__ import annotations

PASSAGES = [
    "The lighthouse on Gull Point was built in 1871 from granite quarried two miles inland. Its keeper, "
    "Elias Brand, kept a log for forty years, noting every storm, every wreck and every passing whale. "
    "In the winter of 1893 the lamp failed for one night, and Brand rowed out to warn a schooner by lantern.",
    "Shipment 4471 left the port of Valdera on a Tuesday morning and was stored in warehouse number 12. "
    "It held three hundred crates of dried figs, forty barrels of olive oil and a single piano wrapped in "
    "felt. The clerk who signed for it, Ada Moreno, noted that one crate was damp.",
    "To bake the harvest loaf, mix four cups of flour with a teaspoon of salt and a packet of yeast. Add warm "
    "water slowly until the dough is soft, then knead it for ten minutes. Let it rise in a warm place for an "
    "hour, shape it, and bake it at two hundred degrees until the crust sounds hollow.",
    "The hotel on Linden Square has five floors and sixty rooms. Maria Okafor checked in on Friday and was "
    "given room 305 on the third floor, facing the square. She asked for a wake-up call at six, because her "
    "train to the coast left at seven fifteen.",
    "In the lab, sample B-17 was drawn from the northern well on March 3rd and assigned to batch 88. Its "
    "nitrate level was twice the safe limit, so the technician, Jonas Berg, flagged it for a second test. "
    "The retest a week later confirmed the first result.",
    "The city chess final was played in the old library. Priya Nair won with the black pieces after "
    "fifty-two moves, trading her queen for two rooks in the middlegame. Her opponent, the defending champion "
    "Tom Weller, resigned when her passed pawn reached the seventh rank.",
    "Every spring the river floods the lower meadow, leaving a layer of silt that makes the soil rich. The "
    "farmers plant barley there in May, after the water has drained, and harvest it in August. In dry years "
    "they open a small canal from the mill pond to water the fields.",
    "The museum's new wing opened in October with an exhibition of maps. The oldest, drawn on vellum around "
    "1450, shows the coast of Portugal in surprising detail. A later map from 1602 places a large island west "
    "of Ireland that no sailor has ever found.",
]

QUESTIONS = [
    "Which warehouse was shipment 4471 stored in? Answer with the number only.",
    "What is Maria Okafor's room number? Answer with the number only.",
    "Which batch was sample B-17 assigned to? Answer with the number only.",
    "In what year was the lighthouse built? Answer with the year only.",
]

__all__ = ["PASSAGES", "QUESTIONS"]
