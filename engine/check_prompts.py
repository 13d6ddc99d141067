"""The model check's short prompts (engine/model_check.py): invented people, places and numbers, so that the answer
must come from the passages, and a blend that gets a family's rotary, norms or attention wrong shows it."""

# (title, text) x 3 and a question: invented people, places and numbers
PROMPTS: tuple[tuple[tuple[tuple[str, str], ...], str], ...] = (
    ((("Varnholt Bridge", "The Varnholt Bridge over the river Esk was finished in 1893 by the engineer Odile "
       "Marrant. It has eleven stone arches and carried trams until 1961, when the town of Brelle closed its line."),
      ("Odile Marrant", "Odile Marrant was born in Quessac in 1851. Before the bridge she built the Quessac "
       "waterworks, and after it she taught at the mining school in Dunmore until her death in 1920."),
      ("Brelle trams", "Brelle's trams ran green cars on two lines. The Esk line crossed the Varnholt Bridge; the "
       "hill line climbed to the old market. Both were replaced by buses painted yellow.")),
     "In which town was the engineer of the Varnholt Bridge born?"),
    ((("Pellin Island", "Pellin Island lies forty kilometres off the coast of Marrow Bay. Its only village, "
       "Tessaly, keeps a lighthouse whose lamp has been lit by the Orrin family since 1874."),
      ("The Orrin family", "The Orrins came to Pellin from the mainland town of Caddow. Their eldest, Jory Orrin, "
       "kept the lamp for fifty-two years and wrote a book on seabirds called The Grey Wing."),
      ("The Grey Wing", "The Grey Wing describes thirty-one kinds of seabird seen from the Tessaly lighthouse. It was "
       "printed in 1911 in an edition of four hundred copies.")),
     "What is the name of the book written by the lighthouse keeper of Pellin Island?"),
    ((("Kestrel Motors", "Kestrel Motors was founded in 1934 in the city of Oldwick by the brothers Amos and Luther "
       "Penhale. Its first car, the Kestrel Six, had a blue enamel badge and a top speed of 110 km/h."),
      ("Luther Penhale", "Luther Penhale left Kestrel Motors in 1940 to build gliders. He later moved to the village "
       "of Ambry, where he grew apples and kept bees until 1977."),
      ("Oldwick", "Oldwick is a river port with a cathedral, a canal and a museum of cars. Its museum holds the last "
       "Kestrel Six ever built, painted red, and the workbench of the Penhale brothers.")),
     "Where did the co-founder of Kestrel Motors who built gliders later live?"),
    ((("Lake Sorrow", "Lake Sorrow is a mountain lake at 2,140 metres in the Vell range. It is fed by the Tamsin "
       "glacier and drains into the river Ould, which reaches the sea at the port of Haverlow."),
      ("Tamsin glacier", "The Tamsin glacier is named after Tamsin Greave, a surveyor who mapped the Vell range in "
       "1888. It has lost about a third of its length since her survey."),
      ("Haverlow", "Haverlow exports timber and slate. Its harbour wall, the Long Mole, is 900 metres long, and a "
       "statue of a fisherman named Caleb Voss stands at its end.")),
     "Which port does the river fed by Lake Sorrow reach the sea at?"),
    ((("The Quillon Prize", "The Quillon Prize is given every three years for a work of chamber music. It was first "
       "awarded in 1952 to the composer Ines Calvary for her String Quartet in F."),
      ("Ines Calvary", "Ines Calvary studied the cello in the city of Lorn and played with the Lorn Quartet for ten "
       "years. She wrote four string quartets and one opera, The Salt Queen."),
      ("The Salt Queen", "The Salt Queen is an opera in three acts set in a mining town. It was first staged in Lorn "
       "in 1960 and has not been staged since 1974.")),
     "What opera did the first winner of the Quillon Prize write?"),
)
